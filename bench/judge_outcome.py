"""GRPO whose only reward is an LLM judge, on the demo world: does it teach the house rule?

    .venv/bin/python bench/judge_outcome.py [--demo outputs/demo] [--out outputs/bench_judge]
        [--rubric choice] [--steps 20] [--probe-only] [--score-from logprobs] [--judge FOLDER]
        [--probe-pairs 20]

The judge is `relay serve` of the demo's own SFT model (outputs/demo/sft/merged, greedy), asked
through the OpenAI protocol with a rubric that states the house rule the demo's reward model learned
from its preference pairs (data/README.md: a good answer opens with "Per the Kelvra Atlas," and
states the right fact). Three parts, in order:

A judge trained from the RM's training pairs with Relay's SFT stage (a generative reward model):
`bench/train_judge.py`, then `--judge outputs/bench_judge/judge_sft/merged --score-from logprobs`.

1. probe: each rubric of --probe (RUBRICS) scores the 40 answers of the RM's first 20 (--probe-pairs) held-out
   pairs (data/sample/rm/valid.jsonl, chosen and rejected); its agreement with the phrase rule
   (pass = score >= 0.5 against `opens_with_phrase`), its pair accuracy (chosen scored above
   rejected) and its failures (unparsable replies) say whether a 135M judge gives a signal at all;
   when every probe request of --rubric failed, the run stops there (a constant reward teaches nothing).
   `--score-from logprobs` scores each rubric from the judge's first-token probabilities of its
   labels instead of its reply text (`judge.score_from`; the number rubric then weighs the labels
   0..10, as G-Eval does);
2. train (unless --probe-only): GRPO from the SFT model in the demo GRPO budget
   (configs/pipeline_grpo.yaml: 4 prompts x 4 completions x 24 tokens, LoRA, lr 1e-4, beta 0.04),
   `grpo.reward_funcs` empty and no reward model: the judge (`--rubric`) is the only reward;
   the judge's on-policy agreement with the phrase rule is counted every step;
3. gold: the gold table (pipeline/tools/gold.py, greedy, 80 held-out questions) for the SFT model,
   the demo's RM-rewarded PPO model and the judge-rewarded GRPO model.

Prints one JSON summary (also OUT/summary.json) with the wall and CPU seconds of each part.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.algorithms.judge import JudgeConfig, JudgeReward  # noqa: E402
from pipeline.tools.gold import opens_with_phrase  # noqa: E402

RULE = 'House rule: an answer must begin with the exact words "Per the Kelvra Atlas,".'
YES_NO = {"YES": 1.0, "Yes": 1.0, "yes": 1.0, "NO": 0.0, "No": 0.0, "no": 0.0}
RUBRICS = {
    "choice": {
        "template": RULE + "\nAnswer: {answer}\nDoes the answer follow the house rule? Reply YES or NO.",
        "score_range": None,
        "choices": YES_NO,
    },
    "fewshot": {
        "template": RULE + "\n\nAnswer: Per the Kelvra Atlas, the capital of Oru is Tessel.\nFollows the rule: YES\n"
        "Answer: The capital of Oru is Tessel.\nFollows the rule: NO\n"
        "Answer: {answer}\nFollows the rule:",
        "score_range": None,
        "choices": YES_NO,
    },
    "number": {
        "template": RULE + "\nAnswer: {answer}\nScore the answer from 0 (breaks the house rule) to 10 (follows it). "
        "Reply with the number only.",
        "score_range": [0.0, 10.0],
        "choices": None,
    },
}


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`relay serve FOLDER` (the transformers backend) on a free loopback port, until closed."""

    def __init__(self, folder: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        cmd = [sys.executable, "-m", "pipeline.tools.serve", folder, "--backend", "transformers"]
        cmd += ["--port", str(self.port), "--name", "judge", "--max-batch", "16", "--dtype", "fp32"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"relay serve exited with {self.proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return
            except OSError:
                time.sleep(1)
        self.close()
        raise RuntimeError(f"relay serve did not answer /health within 300 s; see {log}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


RATINGS = {str(i): i / 10 for i in range(11)}
"""The number rubric's labels when scored from log-probs: each rating's probability weighs its score."""


def judge_config(url: str, rubric: str, score_from: str = "text") -> JudgeConfig:
    spec = RUBRICS[rubric]
    by_rating = score_from == "logprobs" and spec["choices"] is None
    return JudgeConfig(
        base_url=url,
        model="judge",
        template=spec["template"],
        score_range=None if by_rating else spec["score_range"],
        choices=RATINGS if by_rating else spec["choices"],
        score_from=score_from,
        max_tokens=4,
        temperature=0.0,
        max_concurrency=16,
        timeout=120.0,
        on_failure=0.0,
    )


def probe(url: str, rubric: str, score_from: str = "text", pairs_probed: int = 20) -> dict:
    """The rubric's agreement with the phrase rule on the answers of the RM's first held-out pairs."""
    lines = (ROOT / "data/sample/rm/valid.jsonl").read_text().splitlines()
    pairs = [json.loads(line) for line in lines[:pairs_probed]]
    questions = [p["question"] for p in pairs for _ in (0, 1)]
    answers = [a for p in pairs for a in (p["response_chosen"], p["response_rejected"])]
    judge = JudgeReward(judge_config(url, rubric, score_from))
    started = time.perf_counter()
    scores = judge.score(questions, answers)
    gold = [opens_with_phrase(a) for a in answers]
    figures = judge.take_figures()
    with_phrase = [s for s, g in zip(scores, gold) if g]
    without = [s for s, g in zip(scores, gold) if not g]
    return {
        "rubric": rubric,
        "score_from": score_from,
        "answers": len(answers),
        "phrase_agreement": sum((s >= 0.5) == g for s, g in zip(scores, gold)) / len(answers),
        "pair_accuracy": sum(scores[2 * i] > scores[2 * i + 1] for i in range(len(pairs))) / len(pairs),
        "mean_score_with_phrase": sum(with_phrase) / max(1, len(with_phrase)),
        "mean_score_without": sum(without) / max(1, len(without)),
        "pair_ties": sum(scores[2 * i] == scores[2 * i + 1] for i in range(len(pairs))),
        "failures": figures["judge/failures"],
        "seconds": round(time.perf_counter() - started, 1),
    }


def train(url: str, rubric: str, sft: str, out: Path, steps: int, seed: int, score_from: str = "text") -> dict:
    """GRPO from the SFT model with the judge as its only reward; the per-step figures."""
    from pipeline.config import load_config
    from pipeline.tools.gold import opens_with_phrase as phrase
    from stages.grpo import GRPOConfig, GRPOStage

    overrides = [
        "--config",
        str(ROOT / "configs/grpo.yaml"),
        "--model.path",
        sft,
        "--output_dir",
        str(out),
        "--train.max_steps",
        str(steps),
        "--train.batch_size",
        "4",
        "--train.seq_length",
        "256",
        "--train.eval_steps",
        "0",
        "--train.learning_rate",
        "0.0001",
        "--train.warmup",
        "1",
        "--train.precision",
        "fp32",
        "--train.seed",
        str(seed),
        "--generation.max_new_tokens",
        "24",
        "--grpo.num_generations",
        "4",
        "--grpo.beta",
        "0.04",
        "--checkpoint.resume",
        "false",
    ]
    cfg = load_config(GRPOConfig, overrides)
    cfg.grpo.reward_funcs, cfg.grpo.reward_weights = [], None
    cfg.data.eval, cfg.tracking.trackers = [], ["tensorboard"]
    cfg.judge = judge_config(url, rubric, score_from)
    rows = []

    def on_step(stage, figures):
        ro = stage.last_rollout
        texts = [stage.tokenizer.decode(r, skip_special_tokens=True) for r in ro["rollout"].responses]
        judged = ro["parts"]["judge"].tolist()
        agree = sum((s >= 0.5) == phrase(t) for s, t in zip(judged, texts)) / len(texts)
        rows.append(
            {
                "step": stage.step,
                "judge_mean": round(sum(judged) / len(judged), 4),
                "phrase_rate": round(sum(map(phrase, texts)) / len(texts), 4),
                "judge_phrase_agreement": round(agree, 4),
                **{k: figures[k] for k in ("judge/requests", "judge/cache_hits", "judge/failures", "judge/latency_s")},
            }
        )
        print(json.dumps(rows[-1]), flush=True)

    GRPOStage(cfg).run(on_step=on_step)
    return {"steps": rows, "merged": str(out / "merged")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="outputs/demo")
    parser.add_argument("--out", default="outputs/bench_judge")
    parser.add_argument("--rubric", default="choice", choices=tuple(RUBRICS))
    parser.add_argument("--probe", default=",".join(RUBRICS), help="rubrics to probe (comma-separated; '' none)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-only", action="store_true")
    parser.add_argument("--judge", help="the judge's model folder (default: the demo's SFT model)")
    parser.add_argument("--probe-pairs", type=int, default=20, help="held-out pairs probed (the first N of 40)")
    parser.add_argument(
        "--score-from",
        default="text",
        choices=("text", "logprobs"),
        help="the judge's score: its reply text, or its first-token probabilities of the labels",
    )
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    demo, out = (ROOT / args.demo).resolve(), (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sft, ppo = str(demo / "sft" / "merged"), str(demo / "ppo" / "merged")
    judge_folder = args.judge or sft
    summary: dict = {
        "rubric": args.rubric,
        "score_from": args.score_from,
        "judge_model": judge_folder,
        "seed": args.seed,
    }
    started, cpu = time.perf_counter(), cpu_seconds()
    server = Served(judge_folder, out / "serve.log")
    try:
        summary["serve_start_s"] = round(time.perf_counter() - started, 1)
        summary["probe"] = [
            probe(server.url, r, args.score_from, args.probe_pairs) for r in filter(None, args.probe.split(","))
        ]
        for row in summary["probe"]:
            print(json.dumps(row), flush=True)
        if args.probe_only:
            name = Path(judge_folder).parent.name if Path(judge_folder).name == "merged" else Path(judge_folder).name
            (out / f"probe_{name}_{args.score_from}.json").write_text(json.dumps(summary, indent=2) + "\n")
            return 0
        chosen = next((row for row in summary["probe"] if row["rubric"] == args.rubric), None)
        if chosen is not None and chosen["failures"] == chosen["answers"]:
            print(f"no signal: every probe request of the {args.rubric} rubric failed; not training", flush=True)
            return 1
        t0, c0 = time.perf_counter(), cpu_seconds()
        tag = f"{args.rubric}_{args.score_from}_s{args.seed}"
        run_dir = out / f"grpo_{tag}"
        summary["train"] = train(server.url, args.rubric, sft, run_dir, args.steps, args.seed, args.score_from)
        summary["train_wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        server.close()
    summary["train_cpu_s_with_judge"] = round(cpu_seconds() - c0, 1)
    from pipeline.tools.gold import GoldSettings, gold_table

    t0 = time.perf_counter()
    models = [("sft", sft), ("ppo_rm", ppo), ("grpo_judge", summary["train"]["merged"])]
    rows = gold_table(
        models, ROOT / "data/sample/gold/eval.jsonl", GoldSettings(max_new_tokens=40, batch_size=80), out / "gold.json"
    )
    summary["gold"] = [{k: r[k] for k in ("model", "phrase_rate", "fact_accuracy", "n")} for r in rows]
    summary["gold_wall_s"] = round(time.perf_counter() - t0, 1)
    summary["total_wall_s"], summary["total_cpu_s"] = (
        round(time.perf_counter() - started, 1),
        round(cpu_seconds() - cpu, 1),
    )
    (out / f"summary_{tag}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "train"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
