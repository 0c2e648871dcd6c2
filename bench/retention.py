"""Outcome: does mixing general text back into a domain PT run buy back general ability?

    python bench/retention.py [--weight 0.3] [--steps 30] [--out outputs/retention] [--model embedded]

Two PT runs from the same base with the demo's PT settings (configs/demo.yaml: full fine-tuning, fp32,
batch 4 x 128 tokens, lr 5e-4, seed 0): `domain` on the Kelvra corpus alone (data/sample/pt/train.jsonl)
for --steps steps, and `mixed` on the same corpus with Relay's general replay text
(data/general/train.jsonl) mixed back in at --weight (`data.weights: [1 - w, w]`), for
steps / (1 - w) steps, so both see the same number of domain samples on average. Then, in one process:

- general ability, through lm-evaluation-harness (`relay eval`'s scoring): relay_general_mc accuracy and
  the perplexity on held-out general prose (relay_general_text), for base, domain and mixed;
- domain figures: the gold table (data/sample/gold/eval.jsonl: greedy answers scored for the house
  phrase and the right Kelvra fact) and the PT run's held-out domain loss (data/sample/pt/valid.jsonl).

Prints both tables and writes OUT/retention.json. Finished runs are reused (delete OUT to start over).
Not a test: a few minutes of CPU; the figures are in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.tools.evaluate import DEFAULT_TASKS, SHIPPED_TASKS, BenchmarkConfig, evaluate_models, retention_table  # noqa: E402
from pipeline.tools.gold import GoldSettings, format_table, gold_table  # noqa: E402

DOMAIN = ROOT / "data" / "sample" / "pt" / "train.jsonl"
DOMAIN_EVAL = ROOT / "data" / "sample" / "pt" / "valid.jsonl"
GENERAL = ROOT / "data" / "general" / "train.jsonl"
GOLD = ROOT / "data" / "sample" / "gold" / "eval.jsonl"


def pt_run(out: Path, model: str, steps: int, train: list[Path], weights: list[float] | None) -> float:
    """Run PT into `out` unless its merged model exists; return the wall seconds it took (0 when reused)."""
    if (out / "merged" / "manifest.json").is_file():
        return 0.0
    argv = [
        *(sys.executable, str(ROOT / "stages" / "pretrain.py"), "--config", str(ROOT / "configs" / "pt.yaml")),
        *("--output_dir", str(out), "--model.path", model, "--model.finetuning", "full"),
        *("--train.max_steps", str(steps), "--train.batch_size", "4", "--train.grad_accum", "1"),
        *("--train.seq_length", "128", "--train.learning_rate", "0.0005", "--train.warmup", "1"),
        *("--train.precision", "fp32", "--train.eval_steps", str(steps), "--train.seed", "0"),
        *("--data.train", "[" + ",".join(map(str, train)) + "]", "--data.eval", f"[{DOMAIN_EVAL}]"),
    ]
    if weights is not None:
        argv += ["--data.weights", "[" + ",".join(f"{w:g}" for w in weights) + "]"]
    started = time.time()
    subprocess.run(argv, check=True, cwd=ROOT)
    return round(time.time() - started, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--weight", type=float, default=0.3, help="sampling probability of the general text")
    parser.add_argument("--steps", type=int, default=30, help="PT steps of the domain-only run")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "retention"))
    parser.add_argument(
        "--domain",
        help="an existing domain-only PT output folder with the same settings to reuse (e.g. outputs/demo/pt, "
        "the demo's PT), instead of running it",
    )
    args = parser.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = Path(args.out)
    mixed_steps = round(args.steps / (1 - args.weight))
    domain = Path(args.domain) if args.domain else out / "domain"
    seconds = {
        "domain": pt_run(domain, args.model, args.steps, [DOMAIN], None),
        "mixed": pt_run(out / "mixed", args.model, mixed_steps, [DOMAIN, GENERAL], [1 - args.weight, args.weight]),
    }
    from pipeline.modeling.embedded import materialize

    base = str(materialize()) if args.model == "embedded" else args.model
    models = [
        ("base", base),
        ("pt domain", str(domain / "merged")),
        ("pt mixed", str(out / "mixed" / "merged")),
    ]
    started = time.time()
    table = evaluate_models(models, BenchmarkConfig(tasks=list(DEFAULT_TASKS), include_path=[str(SHIPPED_TASKS)]))
    eval_seconds = round(time.time() - started, 1)
    started = time.time()
    gold = gold_table(models, GOLD, GoldSettings(max_new_tokens=40, batch_size=80))
    gold_seconds = round(time.time() - started, 1)
    losses = {
        name: json.loads((folder / "summary.json").read_text()).get("eval_loss_last")
        for name, folder in (("domain", domain), ("mixed", out / "mixed"))
    }
    result = {
        "weight": args.weight,
        "steps": {"domain": args.steps, "mixed": mixed_steps},
        "pt_seconds": seconds,
        "benchmarks": table,
        "benchmark_seconds": eval_seconds,
        "gold": gold,
        "gold_seconds": gold_seconds,
        "domain_eval_loss": losses,
    }
    (out / "retention.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"general ability (lm-evaluation-harness, {eval_seconds} s for 3 models):")
    print(retention_table(table))
    print(f"\ndomain figures (gold table, {gold_seconds} s; PT held-out domain loss {losses}):")
    print(format_table(gold))
    print(f"\nPT wall seconds {seconds}; steps {result['steps']}; general weight {args.weight}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
