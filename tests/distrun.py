"""Run several stages one after another in one process: under torchrun (every rank runs this
file) or in-process (the one-process references), for tests/test_distributed_stages.py.

    torchrun --nproc_per_node 2 tests/distrun.py RUNS.json

RUNS.json is a list of {"stage": "pt"|"sft"|"rm"|"dpo"|"ppo"|"grpo", "argv": [...], "stop_after":
k or null, "sampler": "scripted" (default) or "real" (PPO, GRPO), "history": the history file's
name (default "history"), "grad_norms": true to record per-parameter gradient norms}.
Each run writes `<output_dir>/history-rank<r>.json`: {"steps": every step's figures as this rank
logged them, "evals": every evaluation's, "resumed_at": the step it resumed from (0: a fresh
start), "batch_ids": the sample indices of every step's micro-batches on this rank, "grad_norms":
the first optimizer steps' gradient norm per parameter when the run asked for them, else []}, so
a test can compare curves and held-out figures, check that every rank logged the same grad_norm,
which samples each step trained, and which parameters two runs' gradients part on.
Starting the interpreter, torch and transformers costs most of a tiny run, so one process runs
them all.

PPO runs sample with `ScriptedGenerator` and score with `scripted_reward`: responses and rewards
are pure functions of the prompt, so a run's rollouts do not depend on how prompts are dealt to
ranks, and N ranks of B prompts must update exactly as one process of N x B. GRPO runs sample
with `GroupGenerator` (a pure function of the prompt and the copy's place in its group, so a
group's completions differ) and score with `group_reward`.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for entry in (str(ROOT), str(ROOT / "tests")):
    if entry not in sys.path:
        sys.path.insert(0, entry)

STOP_ENV = "RELAY_STOP_AFTER_STEP"
GRAD_NORM_STEPS = 8
"""Optimizer steps whose per-parameter gradient norms a run that asks for them records."""
EOS_ID = 2  # the embedded tokenizer's <|im_end|>


class ScriptedGenerator:
    """Responses of 1-6 tokens that depend only on the prompt; rows whose length hits 6 end
    without EOS (unfinished), the others with EOS."""

    def generate(self, prompts):
        out = []
        for prompt in prompts:
            seed = sum(prompt) + 31 * len(prompt)
            length = 1 + seed % 6
            body = [100 + (seed * 7 + 13 * i) % 900 for i in range(length)]
            out.append(body if length == 6 else body[:-1] + [EOS_ID])
        return out


class GroupGenerator(ScriptedGenerator):
    """ScriptedGenerator with the copy's place among the identical prompts of the call mixed in."""

    def generate(self, prompts):
        seen: dict = {}
        out = []
        for prompt in prompts:
            copy = seen[tuple(prompt)] = seen.get(tuple(prompt), -1) + 1
            out += super().generate([list(prompt) + [7 * copy + 1]])
        return out


def group_reward(prompts, completions):
    """A GRPO reward function: a pure function of the completion's text."""
    return [float(len(c) % 5) / 4 for c in completions]


def sparse_reward(prompts, completions):
    """A GRPO reward function with no opinion (None) on most completions: the ranks hold unequal
    numbers of scored completions (a per-rank mean weighs them unequally)."""
    return [None if len(c) % 3 else len(c) / 10 for c in completions]


def odd_constant_reward(prompts, completions):
    """A GRPO reward function that teaches nothing on a prompt with an odd number (the same reward
    for every completion: dynamic sampling drops its group), group_reward's on the others."""
    import re

    odd = [int(re.search(r"number (\d+)", p).group(1)) % 2 for p in prompts]
    return [0.5 if o else r for o, r in zip(odd, group_reward(prompts, completions))]


def scripted_reward(prompt_texts, responses):
    import torch

    return torch.tensor([0.25 * len(r) - 0.1 * (r[0] % 7) + 0.01 * len(t) for t, r in zip(prompt_texts, responses)])


def stage_class(name: str):
    from stages.dpo import DPOStage
    from stages.grpo import GRPOStage
    from stages.ppo import PPOStage
    from stages.pretrain import PTStage
    from stages.reward import RMStage
    from stages.sft import SFTStage

    return {"pt": PTStage, "sft": SFTStage, "rm": RMStage, "dpo": DPOStage, "ppo": PPOStage, "grpo": GRPOStage}[name]


def stage_kwargs(spec: dict) -> dict:
    """The sampler and reward of a PPO / GRPO run (none for the real sampler)."""
    scripted = spec.get("sampler", "scripted") == "scripted"
    if spec["stage"] == "ppo":
        return (
            {"generator_factory": lambda policy: ScriptedGenerator(), "reward_fn": scripted_reward}
            if scripted
            else {"reward_fn": scripted_reward}
        )
    if spec["stage"] == "grpo" and scripted:
        return {"generator_factory": lambda policy: GroupGenerator()}
    return {}


@contextlib.contextmanager
def per_parameter_grad_norms(record: list):
    """Record the first GRAD_NORM_STEPS optimizer steps' gradient norm of every parameter (before
    clipping; whole under FSDP; keyed by the unwrapped model's names) into `record`: where two
    runs' global norms part, these say which parameters part first, and at which step."""
    from pipeline.engine import steps
    from pipeline.engine.fsdp import full_tensor

    measure = steps.grad_norm_tensor

    def recording(model, accelerator, max_norm):
        if len(record) < GRAD_NORM_STEPS and not steps.is_deepspeed(accelerator):
            record.append(
                {
                    name.removeprefix("module."): float(full_tensor(p.grad.detach().norm()))
                    for name, p in model.named_parameters()
                    if p.grad is not None
                }
            )
        return measure(model, accelerator, max_norm)

    steps.grad_norm_tensor = recording
    try:
        yield
    finally:
        steps.grad_norm_tensor = measure


def run_one(spec: dict) -> None:
    """Run one stage (stopping after `stop_after` when set) and write this rank's history."""
    from stagerun import fresh_accelerate

    from pipeline.config import load_config

    fresh_accelerate()
    base = stage_class(spec["stage"])

    class cls(base):  # records the step the run resumed from, the samples of every step and the sampler
        resumed_at = 0
        batch_ids: list = []
        sampler = None

        def release(self):
            self.sampler = type(getattr(self, "_generator", None)).__name__
            super().release()

        def resume(self):
            super().resume()
            self.resumed_at = self.step

        def next_sample_indices(self, grad_accum=None):
            groups = super().next_sample_indices(grad_accum)
            self.batch_ids = self.batch_ids + [groups]
            return groups

    kwargs = stage_kwargs(spec)
    if spec.get("stop_after") is not None:
        os.environ[STOP_ENV] = str(spec["stop_after"])
    grad_norms: list = []
    try:
        with per_parameter_grad_norms(grad_norms) if spec.get("grad_norms") else contextlib.nullcontext():
            stage = cls(load_config(cls.config_class, spec["argv"]), **kwargs)
            stage.run()
    finally:
        os.environ.pop(STOP_ENV, None)
    rank = stage.accelerator.process_index
    steps, evals = (
        [{k: v for k, v in record.items() if isinstance(v, (int, float))} for record in records]
        for records in (stage.history.steps, stage.history.evals)
    )
    out = Path(stage.cfg.output_dir) / f"{spec.get('history', 'history')}-rank{rank}.json"
    out.write_text(
        json.dumps(
            {
                "steps": steps,
                "evals": evals,
                "resumed_at": stage.resumed_at,
                "batch_ids": stage.batch_ids,
                "grad_norms": grad_norms,
                "sampler": stage.sampler,
            }
        )
    )
    stage.accelerator.wait_for_everyone()
    fresh_accelerate()


def keep_backends(specs: list[dict]) -> None:
    """Import bitsandbytes before the first run when any run is QLoRA, and DeepSpeed when any runs
    under it: a stage hides backends its config does not ask for, so a QLoRA run after a LoRA one
    (a DeepSpeed run after a DDP one) in this process would find it missing. Only then: their
    imports cost seconds in every rank."""
    if any("qlora" in spec["argv"] for spec in specs):
        import bitsandbytes  # noqa: F401
    if any("deepspeed" in spec["argv"] for spec in specs):
        import deepspeed  # noqa: F401


def run_all(specs: list[dict]) -> None:
    keep_backends(specs)
    for spec in specs:
        stage_class(spec["stage"])
    # The imports live as long as the process: out of reach of the full collection every run's
    # export makes (accelerate's free_memory), which then scans that run's objects only.
    gc.collect()
    gc.freeze()
    for spec in specs:
        start = time.perf_counter()
        run_one(spec)
        out = spec["argv"][spec["argv"].index("--output_dir") + 1]
        print(f"{Path(sys.argv[0]).stem}: {out} {time.perf_counter() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    run_all(json.loads(Path(sys.argv[1]).read_text()))
