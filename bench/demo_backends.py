"""The demo chain's PPO on two generation backends, side by side (issue 34's goal: with
`generation.backend: vllm` the verdict is PASS and PPO's gold phrase rate and fact accuracy are
within 0.05 of the relay backend's). Reads two finished demo roots, the second made from the
first's PT, SFT and RM folders (so both PPO runs start from the same models):

    bash run_scripts/demo.sh --output_root outputs/demo_relay
    mkdir -p outputs/demo_vllm/gold && cp -r outputs/demo_relay/{pt,sft,rm} outputs/demo_vllm/ \
      && cp outputs/demo_relay/gold/cache.json outputs/demo_vllm/gold/
    bash run_scripts/demo.sh --output_root outputs/demo_vllm --stages.ppo.overrides '{generation: {backend: vllm}}'
    .venv/bin/python bench/demo_backends.py outputs/demo_relay outputs/demo_vllm

Prints one JSON object per root (verdict, the gold rows, PPO's reward and KL per step, the
engine-trainer log-prob diff, each stage's wall seconds) and the goal's check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL = 0.05
"""PPO's gold phrase rate and fact accuracy: at most this far from the relay backend's."""


def gold_rows(summary: dict) -> dict[str, dict]:
    """{model: {phrase_rate, fact_accuracy}} of a pipeline summary's gold table (pure)."""
    rows = (summary.get("gold") or {}).get("rows") or []
    return {r["model"]: {"phrase_rate": r["phrase_rate"], "fact_accuracy": r["fact_accuracy"]} for r in rows}


def curve(scalars: dict, tag: str, digits: int = 4) -> Optional[list[float]]:
    """A TensorBoard tag's values in step order, rounded (None: not logged)."""
    return [round(v, digits) for _, v in scalars[tag]] if tag in scalars else None


def root_figures(root: Path) -> dict:
    """What the comparison reads from one demo root."""
    from pipeline.tools.report import read_scalars

    summary = json.loads((root / "summary.json").read_text(encoding="utf-8"))
    scalars = read_scalars(root / "ppo")
    diff_mean, diff_max = curve(scalars, "rollout/logprob_diff_mean", 9), curve(scalars, "rollout/logprob_diff_max", 9)
    return {
        "root": str(root),
        "verdict": summary["verdict"],
        "gold": gold_rows(summary),
        "ppo_reward_raw": curve(scalars, "ppo/reward_raw"),
        "ppo_kl": curve(scalars, "ppo/kl"),
        "eval_reward": curve(scalars, "eval/reward"),
        "logprob_diff": None
        if diff_mean is None
        else {"mean_of_steps": sum(diff_mean) / len(diff_mean), "max": max(diff_max)},
        "wall_seconds": {
            k.removesuffix("_wall_seconds"): round(v, 1)
            for k, v in summary.items()
            if k.endswith("_wall_seconds") and v is not None
        },
    }


def goal_check(relay: dict, other: dict, model: str = "ppo") -> dict:
    """The goal on two `root_figures`: the other's verdict PASS and its `model` gold row within
    GOAL of relay's in phrase rate and fact accuracy (pure)."""
    a, b = relay["gold"].get(model), other["gold"].get(model)
    if a is None or b is None:
        return {"met": False, "why": f"no {model} gold row"}
    gaps = {k: round(abs(a[k] - b[k]), 4) for k in ("phrase_rate", "fact_accuracy")}
    return {"gaps": gaps, "verdict": other["verdict"], "met": other["verdict"] == "PASS" and max(gaps.values()) <= GOAL}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("relay_root")
    parser.add_argument("other_root")
    args = parser.parse_args(argv)
    missing = [
        str(Path(r) / "summary.json")
        for r in (args.relay_root, args.other_root)
        if not (Path(r) / "summary.json").is_file()
    ]
    if missing:
        parser.exit(2, f"bench/demo_backends.py: {', '.join(missing)}: not found (a finished demo root holds one)\n")
    relay, other = root_figures(Path(args.relay_root)), root_figures(Path(args.other_root))
    for figures in (relay, other):
        print(json.dumps(figures))
    print(json.dumps({"goal": f"ppo gold within {GOAL} of relay's, verdict PASS", **goal_check(relay, other)}))


if __name__ == "__main__":
    main()
