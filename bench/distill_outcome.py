"""On-policy distillation on the demo world: the demo's PPO model teaches its SFT model.

    .venv/bin/python bench/distill_outcome.py [--demo outputs/demo] [--out outputs/bench_distill]
        [--steps 20] [--lr 1e-4] [--beta 0.5] [--lmbda 1.0] [--batch 8] [--name NAME]

Needs a finished demo (bash run_scripts/demo.sh: DEMO/sft/merged and DEMO/ppo/merged). The student
starts from the SFT model and samples its own answers to the PPO prompts (data/sample/ppo), the
teacher (PPO's merged model, in process) scores them, and the student learns the teacher's
next-token distribution (stages/distill.py, LoRA as the demo's PPO, configs/pipeline_distill.yaml's
budget unless overridden). Then:

- per-token KL(student || teacher) on held-out prompts (data/sample/ppo/valid.jsonl, every prompt,
  one sampled answer each, the same seed) before and after: the stage's eval/kl at step 0 and at
  its last step;
- the gold table (pipeline/tools/gold.py: greedy answers to 80 held-out questions) for base,
  the student before (SFT), the student after and the teacher (PPO); rows are cached by weights
  hash in DEMO/gold/cache.json, so the demo's own rows are not decoded again.

Prints one JSON summary (also OUT/NAME/summary.json) with the wall and CPU seconds of each part.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.tools.gold import GoldSettings, gold_table  # noqa: E402

GOLD = ROOT / "data" / "sample" / "gold" / "eval.jsonl"


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def distill(args, out: Path) -> dict:
    """Run the distill stage (its own process, as the pipeline runs it); its summary.json."""
    held_out = ROOT / "data" / "sample" / "ppo" / "valid.jsonl"
    eval_batches = -(-sum(1 for line in held_out.read_text().splitlines() if line.strip()) // args.batch)
    cmd = [
        sys.executable,
        str(ROOT / "stages" / "distill.py"),
        "--config",
        str(ROOT / "configs" / "distill.yaml"),
        "--output_dir",
        str(out),
        "--model.path",
        str((args.demo / "sft" / "merged").resolve()),
        "--teacher.path",
        str((args.demo / "ppo" / "merged").resolve()),
        "--teacher.dtype",
        "fp32",
        "--data.completions",
        "[]",
        "--train.precision",
        "fp32",
        "--train.max_steps",
        str(args.steps),
        "--train.batch_size",
        str(args.batch),
        "--train.seq_length",
        "256",
        "--train.learning_rate",
        str(args.lr),
        "--train.warmup",
        "1",
        "--train.eval_steps",
        str(args.steps),
        "--train.eval_batches",
        str(eval_batches),
        "--train.log_steps",
        "1",
        "--generation.max_new_tokens",
        "24",
        "--distill.beta",
        str(args.beta),
        "--distill.lmbda",
        str(args.lmbda),
    ]
    if args.lmbda < 1:
        cmd[cmd.index("--data.completions") + 1] = "[data/sample/sft/train]"
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads((out / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT / "outputs" / "demo")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_distill")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--lmbda", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--name", default="")
    args = parser.parse_args()
    name = args.name or f"s{args.steps}-lr{args.lr:g}-b{args.beta:g}-l{args.lmbda:g}"
    out = args.out / name
    for stage in ("sft", "ppo"):
        if not (args.demo / stage / "merged" / "manifest.json").is_file():
            print(f"error: {args.demo / stage / 'merged'} is not a finished model: run bash run_scripts/demo.sh first")
            return 2
    started, cpu = time.time(), cpu_seconds()
    summary = distill(args, out)
    train = {"wall_s": round(time.time() - started, 1), "cpu_s": round(cpu_seconds() - cpu, 1)}
    started, cpu = time.time(), cpu_seconds()
    models = [
        ("base", "embedded"),
        ("student before (sft)", str((args.demo / "sft" / "merged").resolve())),
        ("student after (distill)", str((out / "merged").resolve())),
        ("teacher (ppo)", str((args.demo / "ppo" / "merged").resolve())),
    ]
    from pipeline.modeling.embedded import materialize

    models[0] = ("base", str(materialize()))
    rows = gold_table(
        models, GOLD, GoldSettings(max_new_tokens=40, batch_size=80), args.demo / "gold" / "cache.json", out / "answers"
    )
    gold = {"wall_s": round(time.time() - started, 1), "cpu_s": round(cpu_seconds() - cpu, 1)}
    result = {
        "name": name,
        "budget": {
            "steps": args.steps,
            "prompts_per_step": args.batch,
            "max_new_tokens": 24,
            "lr": args.lr,
            "beta": args.beta,
            "lmbda": args.lmbda,
        },
        "eval_kl_before": summary.get("eval_kl_first"),
        "eval_kl_after": summary.get("eval_kl_last"),
        "train_kl_first": summary.get("kl_first"),
        "train_kl_last": summary.get("kl_last"),
        "gold": [{k: r[k] for k in ("model", "phrase_rate", "fact_accuracy", "n")} for r in rows],
        "train": train,
        "gold_table": gold,
    }
    (out / "summary.json").write_text(json.dumps({**summary, "outcome": result}, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
