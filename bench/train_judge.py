r"""Train an LLM judge (a generative reward model) from preference pairs with Relay's SFT stage.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python bench/train_judge.py \
        [--base outputs/demo/sft/merged] [--out outputs/bench_judge/judge_sft] [--rubric choice] \
        [--steps 32] [--batch 4]
    .venv/bin/python bench/judge_outcome.py --probe-only --judge outputs/bench_judge/judge_sft/merged \
        --score-from logprobs --rubric choice          # then without --probe-only: judge-only GRPO + gold

When no judge follows the rubric (a 135M model answers it as one more atlas question, bench/RESULTS.md),
the field's answer is to fine-tune one on judgements derived from preference data (ms-swift's GenRM,
"generative verifiers"). This does it with Relay's own stages, as a user would:

1. data: every pair of the reward model's TRAINING file (data/sample/rm/train.jsonl, never its held-out
   valid.jsonl, which the probe reads) becomes two conversations: user = the judge rubric of
   bench/judge_outcome.py (RUBRICS[--rubric]) rendered with the question and the chosen answer,
   assistant = "Yes"; the same with the rejected answer, assistant = "No" (LABELS: one token each).
   The judge's own `render_messages` renders the rubric, so the judge is trained on exactly the
   request it is sent at serve time. Written to OUT/data/judge_pairs.jsonl (OpenAI `messages`), checked with
   `relay validate --kind sft`;
2. train: `relay train configs/sft.yaml --stage sft` from --base (full fine-tuning, fp32, batches of
   one judgement a row, seq_length 192, lr 2e-4, cosine); the stage merges into OUT/merged. The default
   32 steps x 4 judgements (128 of the 400, a third of an epoch) fit a shared 2-core CPU in ~20 minutes.

Prints one JSON summary (also OUT/judge_summary.json) with the record counts and wall seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.algorithms.judge import JudgeConfig, render_messages  # noqa: E402

LABELS = ("Yes", "No")
"""The judge's reply to an answer that follows the rule / one that does not. The rubric says "YES or NO"
and the judge's choices take every case of both as one label, but SmolLM2's tokenizer splits "YES" into
"Y" + "ES": a judge trained to reply "YES" would put its first-token probability on "Y", which no label
matches under `score_from: logprobs`. "Yes" and "No" are one token each (checked before training)."""


def judge_sft_records(pairs: Sequence[dict], cfg: JudgeConfig, labels: tuple[str, str] = LABELS) -> list[dict]:
    """Two SFT conversations per preference pair (MedicalGPT's question/response_chosen/response_rejected):
    the judge's request for the chosen answer answered labels[0], for the rejected one labels[1] (pure).

    Raises:
        KeyError: a pair lacks one of the three fields.
    """
    out = []
    for pair in pairs:
        for answer, label in ((pair["response_chosen"], labels[0]), (pair["response_rejected"], labels[1])):
            messages = render_messages(cfg, pair["question"], answer)
            out.append({"messages": messages + [{"role": "assistant", "content": label}]})
    return out


def write_data(pairs_file: Path, rubric: str, out: Path, seed: int = 0) -> tuple[Path, int]:
    """OUT/data/judge_pairs.jsonl from the pairs file, shuffled with the seed; the path and record count."""
    from bench.judge_outcome import judge_config

    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines() if line.strip()]
    records = judge_sft_records(pairs, judge_config("http://unused/v1", rubric))
    random.Random(seed).shuffle(records)
    path = out / "data" / "judge_pairs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, len(records)


def label_problems(model: str, labels: Sequence[str] = LABELS) -> list[str]:
    """The labels that are not one token of the model's tokenizer (the log-prob judge reads one token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    pieces = {label: tokenizer.tokenize(label) for label in labels}
    return [
        f"label {label!r} is {len(p)} tokens ({p}) of {model}'s tokenizer" for label, p in pieces.items() if len(p) != 1
    ]


def relay(*args: str) -> None:
    """One `relay` command (python -m pipeline.tools.cli), offline, its output passed through.

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "pipeline.tools.cli", *args], cwd=ROOT, env=env, check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="outputs/demo/sft/merged", help="the model the judge is trained from")
    parser.add_argument("--out", default="outputs/bench_judge/judge_sft")
    parser.add_argument(
        "--pairs", default="data/sample/rm/train.jsonl", help="preference pairs (the RM's training file)"
    )
    parser.add_argument("--rubric", default="choice", help="bench/judge_outcome.py's RUBRICS entry the judge is sent")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", default="0.0002")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = (ROOT / args.out).resolve()
    started = time.perf_counter()
    base = str((ROOT / args.base).resolve())
    problems = label_problems(base)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    data, records = write_data(ROOT / args.pairs, args.rubric, out, args.seed)
    relay("validate", "--kind", "sft", str(data))
    t0 = time.perf_counter()
    relay(
        "train",
        str(ROOT / "configs/sft.yaml"),
        "--stage",
        "sft",
        "--model.path",
        base,
        "--model.finetuning",
        "full",
        "--output_dir",
        str(out),
        "--data.train",
        f"[{data}]",
        "--data.eval",
        "[]",
        "--data.padding_mode",
        "padding",
        "--train.max_steps",
        str(args.steps),
        "--train.batch_size",
        str(args.batch),
        "--train.grad_accum",
        "1",
        "--train.seq_length",
        "192",
        "--train.learning_rate",
        args.lr,
        "--train.warmup",
        "2",
        "--train.eval_steps",
        "0",
        "--train.precision",
        "fp32",
        "--train.log_steps",
        "5",
        "--train.seed",
        str(args.seed),
        "--checkpoint.resume",
        "false",
        "--tracking.trackers",
        "[tensorboard]",
    )
    summary = {
        "base": args.base,
        "pairs": args.pairs,
        "rubric": args.rubric,
        "records": records,
        "steps": args.steps,
        "batch": args.batch,
        "train_wall_s": round(time.perf_counter() - t0, 1),
        "total_wall_s": round(time.perf_counter() - started, 1),
        "merged": str(out / "merged"),
    }
    (out / "judge_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
