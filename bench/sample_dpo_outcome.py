"""`relay sample` then DPO, on the demo world: does DPO on the RM-scored samples raise the RM's
score on held-out prompts?

    .venv/bin/python bench/sample_dpo_outcome.py [--demo outputs/demo] [--out outputs/bench_sample]
        [--seeds 0,1] [--margin 0.5] [--steps 12]

For each seed: `relay sample` (pipeline/tools/sample.py) draws 4 answers to each of the 64 PPO
training prompts from the demo's SFT model (temperature 1, up to 40 tokens), scores them with the
demo's reward model and writes best-vs-worst DPO pairs whose score gap is at least --margin; the
preference validator (`relay validate --kind dpo`) checks the file; the DPO stage trains on it
from the SFT model in the demo DPO chain's budget (configs/pipeline_dpo.yaml: 12 steps x 8 pairs,
LoRA, lr 2e-4, beta 0.1, seeded by the same seed). Then the SFT model and each DPO model answer
the held-out prompts (data/sample/ppo/valid.jsonl and the gold questions, 96 in all, none trained
on) near-greedily (temperature 1e-3, one answer each, through `relay sample --mode sft`, whose
score is the RM's), and the mean RM score of those answers is compared: per seed, and the mean
and spread over seeds.
Every chosen answer's score is also checked to be at least its rejected one's plus the margin.

Prints one JSON summary (also OUT/summary.json) with the wall and CPU seconds of each part.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HELD_OUT = ["data/sample/ppo/valid.jsonl", "data/sample/gold/eval.jsonl"]


def text_of(answer) -> str:
    """A DPO record's answer: a text, or [{"role": "assistant", "content": ...}]."""
    return answer if isinstance(answer, str) else answer[-1]["content"]


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def sample_config(**kw):
    from pipeline.config import PromptDataConfig
    from pipeline.tools.sample import SampleConfig

    files = kw.pop("files")
    settings = {"num_samples": 4, "max_new_tokens": 40, "temperature": 1.0, "batch_size": 8, "seq_length": 256}
    cfg = SampleConfig(data=PromptDataConfig(train=list(files), eval=[]), **{**settings, **kw})
    problems = cfg.problems() + cfg.file_problems()
    if problems:
        raise SystemExit("\n".join(problems))
    return cfg


def held_out_scores(model: str, rm: str, out: Path) -> dict:
    """The RM's mean score of `model`'s near-greedy answers to the held-out prompts, and their phrase rate."""
    from pipeline.tools import sample
    from pipeline.tools.gold import opens_with_phrase

    cfg = sample_config(
        model=model,
        files=[str(ROOT / f) for f in HELD_OUT],
        out=str(out),
        mode="sft",
        num_samples=1,
        temperature=1e-3,
        keep_unfinished=True,
        reward_model=rm,
    )
    counts = sample.run(cfg)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    scores = [r["score"] for r in records]
    return {
        "prompts": counts["prompts"],
        "answered": len(records),
        "rm_mean": round(statistics.fmean(scores), 4),
        "phrase_rate": round(sum(opens_with_phrase(r["messages"][-1]["content"]) for r in records) / len(records), 4),
    }


def train_dpo(sft: str, pairs: Path, out: Path, seed: int, steps: int) -> str:
    from pipeline.config import load_config
    from stages.dpo import DPOConfig, DPOStage

    cfg = load_config(
        DPOConfig,
        [
            "--config",
            str(ROOT / "configs/dpo.yaml"),
            "--model.path",
            sft,
            "--output_dir",
            str(out),
            "--train.max_steps",
            str(steps),
            "--train.batch_size",
            "8",
            "--train.grad_accum",
            "1",
            "--train.seq_length",
            "128",
            "--train.eval_steps",
            "0",
            "--train.learning_rate",
            "0.0002",
            "--train.warmup",
            "1",
            "--train.precision",
            "fp32",
            "--train.seed",
            str(seed),
            "--dpo.precompute_ref_log_probs",
            "false",
            "--checkpoint.resume",
            "false",
        ],
    )
    cfg.data.train, cfg.data.eval, cfg.tracking.trackers = [str(pairs)], [], []
    DPOStage(cfg).run()
    return str(out / "merged")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", default="outputs/demo")
    parser.add_argument("--out", default="outputs/bench_sample")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--margin", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    from data_formats.validate import main as validate
    from pipeline.tools import sample
    from pipeline.tools.gold import opens_with_phrase

    demo, out = (ROOT / args.demo).resolve(), (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sft, rm = str(demo / "sft" / "merged"), str(demo / "rm" / "merged")
    summary: dict = {"margin": args.margin, "dpo_steps": args.steps, "runs": []}
    started, cpu0 = time.perf_counter(), cpu_seconds()
    summary["sft"] = held_out_scores(sft, rm, out / "heldout_sft.jsonl")
    print(json.dumps({"sft": summary["sft"]}), flush=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        t0, c0 = time.perf_counter(), cpu_seconds()
        pairs = out / f"dpo_pairs_s{seed}.jsonl"
        cfg = sample_config(
            model=sft,
            files=[str(ROOT / "data/sample/ppo/train.jsonl")],
            out=str(pairs),
            mode="dpo",
            margin=args.margin,
            seed=seed,
            reward_model=rm,
        )
        counts = sample.run(cfg)
        records = [json.loads(line) for line in pairs.read_text().splitlines()]
        assert all(r["chosen_score"] >= r["rejected_score"] + args.margin for r in records)
        assert validate(["--kind", "rm", str(pairs)]) == 0, "the sampled file does not validate as DPO"
        sample_s = time.perf_counter() - t0
        merged = train_dpo(sft, pairs, out / f"dpo_s{seed}", seed, args.steps)
        run = {
            "seed": seed,
            "pairs": len(records),
            "skipped": counts["skipped"],
            "mean_gap": round(statistics.fmean(r["chosen_score"] - r["rejected_score"] for r in records), 4),
            "chosen_phrase": round(sum(opens_with_phrase(text_of(r["chosen"])) for r in records) / len(records), 4),
            "rejected_phrase": round(sum(opens_with_phrase(text_of(r["rejected"])) for r in records) / len(records), 4),
            "sample_wall_s": round(sample_s, 1),
            **held_out_scores(merged, rm, out / f"heldout_dpo_s{seed}.jsonl"),
            "wall_s": round(time.perf_counter() - t0, 1),
            "cpu_s": round(cpu_seconds() - c0, 1),
        }
        run["rm_gain"] = round(run["rm_mean"] - summary["sft"]["rm_mean"], 4)
        summary["runs"].append(run)
        print(json.dumps(run), flush=True)
    gains = [r["rm_gain"] for r in summary["runs"]]
    summary["rm_gain_mean"] = round(statistics.fmean(gains), 4)
    summary["rm_gain_spread"] = [min(gains), max(gains)]
    summary["rm_gain_stdev"] = round(statistics.stdev(gains), 4) if len(gains) > 1 else None
    summary["total_wall_s"], summary["total_cpu_s"] = (
        round(time.perf_counter() - started, 1),
        round(cpu_seconds() - cpu0, 1),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
