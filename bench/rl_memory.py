"""Peak memory of one GRPO update at Qwen's vocabulary: the RL log-probs through the chunked LM head
(this tree) against the full-vocabulary logits path (the same code with `rollout._FULL_LOGITS`).

    python bench/rl_memory.py [--rows 8] [--completion 512] [--prompt 64] [--vocab 151936] [--out DIR]

Each side runs in a fresh process (`--side before|after`): a tiny-width random Qwen2 (2 layers,
d=64, tied embeddings) with the given vocabulary, fp32 on the CPU, a frozen copy as the reference;
a rollout of `rows` completions of `completion` tokens each (groups of 4 sharing a prompt, as
GRPO samples them); then `grpo.score_completions` (old and reference log-probs) and one
`grpo.grpo_update` (beta 0.04: its forward, loss and backward, and an AdamW step). Reported per
side: the process's peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) at the end and after
the model was built, the scoring and update times, and the log-probs, which the parent compares
across the two sides (max |difference| of 'old' and 'ref'; the loss and gradient norm).
Writes DIR/rl_memory.json and prints a markdown row per side.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib() -> float:
    """This process's peak resident set so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_side(side: str, args, out: Path) -> dict:
    import copy
    import types

    import torch
    from accelerate import Accelerator
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    from pipeline.algorithms.grpo_config import GRPOSection
    from pipeline.config.policy import GenerationConfig
    from pipeline.rl import grpo, rollout

    rollout._FULL_LOGITS = side == "before"
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.prompt + args.completion + 8,
        tie_word_embeddings=True,
    )
    policy = Qwen2ForCausalLM(config).float()
    policy.config._attn_implementation = "sdpa"
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    model = rollout.ActorCritic(policy, None, reference=reference)
    g = torch.Generator().manual_seed(1)
    groups = args.rows // 4
    prompts = [
        torch.randint(3, args.vocab, (args.prompt,), generator=g).tolist() for _ in range(groups) for _ in range(4)
    ]
    responses = [torch.randint(3, args.vocab, (args.completion,), generator=g).tolist() for _ in range(args.rows)]
    ro = rollout.assemble(prompts, responses, pad_id=0, eos_ids=[1])
    accelerator = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    cfg = types.SimpleNamespace(
        grpo=GRPOSection(beta=0.04),
        generation=GenerationConfig(max_new_tokens=args.completion),
        train=types.SimpleNamespace(grad_accum=1, max_grad_norm=1.0),
    )
    built = peak_rss_mib()

    start = time.perf_counter()
    scored = grpo.score_completions(
        model,
        ro,
        micro=args.rows,
        temperature=cfg.generation.temperature,
        autocast=accelerator.autocast,
        old=True,
        reference=True,
    )
    scoring_s = time.perf_counter() - start
    advantages = torch.randn(args.rows, generator=g)
    start = time.perf_counter()
    update = grpo.grpo_update(model, optimizer, ro, advantages, scored, accelerator, cfg, step=1)
    update_s = time.perf_counter() - start
    peak = peak_rss_mib()
    torch.save({k: v for k, v in scored.items()}, out / f"{side}_scored.pt")
    return {
        "side": side,
        "peak_rss_mib": round(peak, 1),
        "built_rss_mib": round(built, 1),
        "scoring_s": round(scoring_s, 2),
        "update_s": round(update_s, 2),
        "loss": update["loss"],
        "grad_norm": update["grad_norm"],
        "ratio_dev_first": update["ratio_dev_first"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--side", choices=("before", "after"), help="run one side in this process (the parent runs both)"
    )
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.rows % 4:
        parser.error("--rows: a multiple of 4 (groups of 4 completions share a prompt)")
    out = args.out or Path(tempfile.mkdtemp(prefix="rl_memory_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.side:
        (out / f"{args.side}.json").write_text(json.dumps(run_side(args.side, args, out)))
        return

    import torch

    results = {}
    for side in ("before", "after"):
        cmd = [
            sys.executable,
            __file__,
            "--side",
            side,
            "--rows",
            str(args.rows),
            "--completion",
            str(args.completion),
            "--prompt",
            str(args.prompt),
            "--vocab",
            str(args.vocab),
            "--out",
            str(out),
        ]
        subprocess.run(cmd, check=True, cwd=ROOT)
        results[side] = json.loads((out / f"{side}.json").read_text())
    before, after = (torch.load(out / f"{s}_scored.pt") for s in ("before", "after"))
    mask = torch.ones_like(before["old"], dtype=torch.bool)
    summary = {
        "rows": args.rows,
        "completion": args.completion,
        "prompt": args.prompt,
        "vocab": args.vocab,
        "sides": results,
        "peak_ratio": round(results["after"]["peak_rss_mib"] / results["before"]["peak_rss_mib"], 3),
        "old_max_abs_diff": float((before["old"] - after["old"])[mask].abs().max()),
        "ref_max_abs_diff": float((before["ref"] - after["ref"])[mask].abs().max()),
    }
    (out / "rl_memory.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print("| side | peak RSS | RSS after build | scoring | update | loss | grad norm |")
    print("|---|---|---|---|---|---|---|")
    for side, r in results.items():
        print(
            f"| {side} | {r['peak_rss_mib']:.0f} MiB | {r['built_rss_mib']:.0f} "
            f"MiB | {r['scoring_s']:.1f} s | {r['update_s']:.1f} s "
            f"| {r['loss']:.6f} | {r['grad_norm']:.6f} |"
        )


if __name__ == "__main__":
    main()
