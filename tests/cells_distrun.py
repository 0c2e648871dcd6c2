"""tests/distrun.py's runner with the runs tests/test_cells_ddp.py adds: the KTO and distill stages
(distill samples with distrun.ScriptedGenerator), and PPO / GRPO with tools sampled by
tests/tool_distrun.py's scripted caller (a pure function of each context, so the rollouts do not
depend on how prompts are dealt to ranks).

    torchrun --nproc_per_node 2 tests/cells_distrun.py RUNS.json

A spec's "sampler" may also be "tools" (`stage_kwargs`), "paired" or "paired-tools" (`paired_hf`);
everything else is tests/distrun.py's.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import distrun

_stage_class, _stage_kwargs, _run_one = distrun.stage_class, distrun.stage_kwargs, distrun.run_one


def stage_class(name: str):
    if name == "kto":
        from stages.kto import KTOStage

        return KTOStage
    if name == "distill":
        from stages.distill import DistillStage

        return DistillStage
    return _stage_class(name)


class Paired:
    """The hf backend's sampler, each call checked against the relay backend's: the relay engine
    samples first, then the RNG is put back and transformers' generate samples; every row must be
    the same ids up to its first EOS (both draw from softmax(logits / T) with the same stream), else
    the run fails naming the call. The hf samples are what the stage trains on."""

    def __init__(self, relay, hf, eos_ids):
        self.relay, self.hf, self.eos_ids = relay, hf, list(eos_ids)
        self.calls = 0

    def generate(self, prompts, max_new_tokens=None):
        import torch

        from pipeline.rl.rollout import cut_at_eos

        self.calls += 1
        state = torch.get_rng_state()
        want = self.relay.generate(prompts, max_new_tokens=max_new_tokens)
        torch.set_rng_state(state)
        got = self.hf.generate(prompts, max_new_tokens=max_new_tokens)
        cut = [[cut_at_eos(r, self.eos_ids) for r in rows] for rows in (got, want)]
        if cut[0] != cut[1]:
            parted = [i for i, (a, b) in enumerate(zip(*cut)) if a != b]
            raise AssertionError(f"sampling call {self.calls}: hf and relay drew different ids in rows {parted}")
        return got


@contextlib.contextmanager
def paired_hf(spec: dict):
    """For the run: the stage's own `generation.backend: hf` sampler (made from its config as every
    run makes it: pipeline/rl/generators.py `GENERATORS`), checked call by call against the relay
    backend's made with the same arguments (`Paired`); "paired-tools": after a fixed first call
    (tests/tool_distrun.py `ForcedFirstCall`; a random tiny policy writes none)."""
    from tool_distrun import ForcedFirstCall
    from transformers import AutoTokenizer

    from pipeline.rl import generators

    argv = spec["argv"]
    tok = AutoTokenizer.from_pretrained(argv[argv.index("--model.path") + 1])
    hf, relay = generators.GENERATORS["hf"], generators.GENERATORS["relay"]

    def make(model, pad_id, eos_ids, max_new_tokens, temperature=1.0, *, synced_gpus=False, **engine):
        own = hf.make(model, pad_id, eos_ids, max_new_tokens, temperature, synced_gpus=synced_gpus, **engine)
        paired = Paired(relay.make(model, pad_id, eos_ids, max_new_tokens, temperature), own, eos_ids)
        return ForcedFirstCall(paired, tok) if spec["sampler"] == "paired-tools" else paired

    generators.GENERATORS["hf"] = hf._replace(make=make)
    try:
        yield
    finally:
        generators.GENERATORS["hf"] = hf


def run_one(spec: dict) -> None:
    """tests/distrun.py's, the hf backend paired with the relay backend's for a "paired" run."""
    with paired_hf(spec) if spec.get("sampler", "").startswith("paired") else contextlib.nullcontext():
        _run_one(spec)


def stage_kwargs(spec: dict) -> dict:
    """tests/distrun.py's, or the scripted tool caller (PPO scored by distrun.scripted_reward, as a
    "paired" PPO run is)."""
    if spec["stage"] == "distill" and spec.get("sampler", "scripted") == "scripted":
        return {"generator_factory": lambda policy: distrun.ScriptedGenerator()}
    sampler = spec.get("sampler", "scripted")
    if sampler.startswith("paired"):
        return {"reward_fn": distrun.scripted_reward} if spec["stage"] == "ppo" else {}
    if sampler != "tools":
        return _stage_kwargs(spec)
    from tool_distrun import Scripted
    from transformers import AutoTokenizer

    argv = spec["argv"]
    tok = AutoTokenizer.from_pretrained(argv[argv.index("--model.path") + 1])
    kwargs = {"generator_factory": lambda policy: Scripted(tok)}
    if spec["stage"] == "ppo":
        kwargs["reward_fn"] = distrun.scripted_reward
    return kwargs


distrun.stage_class, distrun.stage_kwargs, distrun.run_one = stage_class, stage_kwargs, run_one

if __name__ == "__main__":
    distrun.run_all(json.loads(Path(sys.argv[1]).read_text()))
