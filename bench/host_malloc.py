"""A full fine-tuning step of the embedded model on a CPU with freed memory kept in the process
(RELAY_HOST_MALLOC=keep, pipeline/host_memory.py) against glibc's own behaviour (`system`).

    python bench/host_malloc.py [--rounds 2] [--steps 5] [--batch 4] [--seq 128] [--threads N]

Each side runs in a fresh process, alternating `system`, `keep` for `rounds` rounds: the embedded
SmolLM2-135M-Instruct in fp32, trained whole (forward with labels, backward, fused AdamW, gradients
set to None: the step of the demo's PT stage), two warm-up steps, then `steps` timed steps. Reported
per run: seconds a step, the kernel's minor page faults a step (`getrusage`), user and system CPU
seconds a step and the process's peak RSS; then each side's median step and the ratio, with the
machine named. Prints markdown rows; `--json` prints the runs as JSON instead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def side(steps: int, batch: int, seq: int) -> dict:
    """One side's run in this process (RELAY_HOST_MALLOC is already in the environment)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.modeling.embedded import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("embedded"), dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        step()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "step_s": wall / steps,
        "minflt_per_step": (after.ru_minflt - before.ru_minflt) / steps,
        "user_s_per_step": (after.ru_utime - before.ru_utime) / steps,
        "sys_s_per_step": (after.ru_stime - before.ru_stime) / steps,
        "peak_rss_mb": after.ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS for each side (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--side", choices=["keep", "system"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(side(args.steps, args.batch, args.seq)))
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.harness import machine

    runs = []
    for _ in range(args.rounds):
        for name in ("system", "keep"):
            env = dict(os.environ, RELAY_HOST_MALLOC=name, HF_HUB_OFFLINE="1")
            if args.threads:
                env["OMP_NUM_THREADS"] = str(args.threads)
            cmd = [sys.executable, __file__, "--side", name, "--steps", str(args.steps), "--batch", str(args.batch)]
            out = subprocess.run(cmd + ["--seq", str(args.seq)], env=env, cwd=ROOT, capture_output=True, text=True)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            runs.append({"side": name, **json.loads(out.stdout.strip().splitlines()[-1])})
    if args.json:
        print(json.dumps({"machine": machine(), "runs": runs}, indent=1))
        return 0
    print(f"{machine()}; batch {args.batch} x {args.seq} tokens, {args.steps} timed steps a run")
    print("| side | s / step | minor faults / step | user s / step | sys s / step | peak RSS MB | threads |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['side']} | {r['step_s']:.3f} | {r['minflt_per_step']:.0f} | {r['user_s_per_step']:.2f} | "
            f"{r['sys_s_per_step']:.2f} | {r['peak_rss_mb']:.0f} | {r['threads']} |"
        )
    medians = {s: statistics.median(r["step_s"] for r in runs if r["side"] == s) for s in ("system", "keep")}
    print(
        f"median s / step: system {medians['system']:.3f}, keep {medians['keep']:.3f} "
        f"({medians['keep'] / medians['system']:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
