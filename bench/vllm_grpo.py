"""GRPO LoRA step time with each `generation.backend` (relay, hf, vllm) at the harness's GRPO shape
(bench/comparisons/grpo.py's full case: the embedded SmolLM2-135M-Instruct, fp32, 4 prompts x 4
generations x up to 24 new tokens, LoRA r16), one run after another on the same machine; the
vllm row also gives the engine-trainer log-prob diff. Step 1 is warm-up (vLLM's server starts in
it) and is left out of the mean. Unlike the harness, completions may stop at EOS (vLLM's sampler
has no Relay-style min_new_tokens here), so the rows' generated tokens are printed beside them, and the last line gives
each backend's step against relay's (the goal: vllm <= 2x relay, its weight sync included: the adapter is saved
and loaded into the server inside every step's rollout). The trainer and the vLLM server get the
same thread count (--threads; the server's through OMP_NUM_THREADS, which vLLM keeps when it is set): the trainer
waits while the server samples, so neither takes the other's cores.

    RELAY_VLLM_PYTHON=bench/.venv-vllm/bin/python .venv/bin/python bench/vllm_grpo.py \\
        [--steps 6] [--threads 1] [--backends relay,hf,vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(backend: str, steps: int, workdir: str) -> dict:
    from bench import harness
    from bench.comparisons import grpo as bench_grpo
    from pipeline.modeling.embedded import materialize
    from stages.grpo import GRPOStage

    case = dict(bench_grpo.cases(False)[0], steps=steps)
    cfg = bench_grpo.relay_config(case, harness.SideEnv(str(materialize()), workdir, 1, False))
    cfg.generation.backend = backend
    cfg.output_dir = str(Path(workdir) / backend)
    cfg.checkpoint.resume, cfg.tracking.trackers = False, []
    times, rows = [time.perf_counter()], []

    def on_step(stage, figures):
        times.append(time.perf_counter())
        rows.append(
            {
                k: figures.get(k)
                for k in (
                    "grpo/completion_length",
                    "grpo/gen_time_frac",
                    "rollout/logprob_diff_mean",
                    "rollout/logprob_diff_max",
                )
            }
        )

    GRPOStage(cfg).run(on_step=on_step)
    per_step = [b - a for a, b in zip(times, times[1:])]
    warm = per_step[1:] or per_step
    return {
        "backend": backend,
        "s_per_step": round(sum(warm) / len(warm), 2),
        "first_step_s": round(per_step[0], 1),
        "completion_tokens": [r["grpo/completion_length"] for r in rows],
        "gen_time_frac": round(sum(r["grpo/gen_time_frac"] for r in rows[1:]) / max(1, len(rows) - 1), 2),
        "logprob_diff_mean": [r["rollout/logprob_diff_mean"] for r in rows],
        "logprob_diff_max": [r["rollout/logprob_diff_max"] for r in rows],
    }


def against_relay(rows: list[dict]) -> dict:
    """Each backend's warm step over relay's (empty without a relay row); the goal is vllm <= 2."""
    relay = next((r["s_per_step"] for r in rows if r["backend"] == "relay"), None)
    if not relay:
        return {}
    out = {f"{r['backend']}_over_relay": round(r["s_per_step"] / relay, 2) for r in rows if r["backend"] != "relay"}
    if "vllm_over_relay" in out:
        out["vllm_goal_2x"] = "met" if out["vllm_over_relay"] <= 2 else "missed"
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and of the vLLM server")
    parser.add_argument("--backends", default="relay,hf,vllm")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (step 1 is warm-up)")
    import torch

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the vLLM server's (its env is this one's)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for backend in args.backends.split(","):
            rows.append(run(backend, args.steps, workdir))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"threads": args.threads, **against_relay(rows)}), flush=True)


if __name__ == "__main__":
    main()
