"""tests/distrun.py's runner with the runs tests/test_cells_ddp.py adds: the KTO and distill stages
(distill samples with distrun.ScriptedGenerator), and PPO / GRPO with tools sampled by
tests/tool_distrun.py's scripted caller (a pure function of each context, so the rollouts do not
depend on how prompts are dealt to ranks).

    torchrun --nproc_per_node 2 tests/cells_distrun.py RUNS.json

A spec's "sampler" may also be "tools", "forced", "paired" or "paired-tools" (`stage_kwargs`);
everything else is tests/distrun.py's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import distrun

_stage_class, _stage_kwargs = distrun.stage_class, distrun.stage_kwargs


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
    the same ids (both draw from softmax(logits / T) with the same stream), else the run fails
    naming the call. The hf samples are what the stage trains on."""

    def __init__(self, relay, hf, eos_id: int):
        self.relay, self.hf, self.eos_id = relay, hf, eos_id
        self.calls = 0

    def generate(self, prompts, max_new_tokens=None):
        import torch

        from pipeline.rl.rollout import cut_at_eos

        self.calls += 1
        state = torch.get_rng_state()
        want = self.relay.generate(prompts, max_new_tokens=max_new_tokens)
        torch.set_rng_state(state)
        got = self.hf.generate(prompts, max_new_tokens=max_new_tokens)
        cut = [[cut_at_eos(r, [self.eos_id]) for r in rows] for rows in (got, want)]
        if cut[0] != cut[1]:
            parted = [i for i, (a, b) in enumerate(zip(*cut)) if a != b]
            raise AssertionError(f"sampling call {self.calls}: hf and relay drew different ids in rows {parted}")
        return got


def stage_kwargs(spec: dict) -> dict:
    """tests/distrun.py's, or another sampler (PPO scored by distrun.scripted_reward): "tools" the
    scripted tool caller; "paired" the hf backend's sampler checked against the relay backend's
    (`Paired`), "paired-tools" the same after a fixed first call (tests/tool_distrun.py)."""
    if spec["stage"] == "distill" and spec.get("sampler", "scripted") == "scripted":
        return {"generator_factory": lambda policy: distrun.ScriptedGenerator()}
    if spec.get("sampler") not in ("tools", "forced", "paired", "paired-tools"):
        return _stage_kwargs(spec)
    from tool_distrun import ForcedFirstCall, Scripted
    from transformers import AutoTokenizer

    from pipeline.rl.generators import make_generator

    argv, sampler = spec["argv"], spec["sampler"]
    tok = AutoTokenizer.from_pretrained(argv[argv.index("--model.path") + 1])
    limit = int(flag(argv, "--generation.max_new_tokens", "64"))

    def own(backend: str, policy):
        return make_generator(backend, policy, tok.pad_token_id, [tok.eos_token_id], limit)

    def factory(policy):
        if sampler == "tools":
            return Scripted(tok)
        if sampler == "forced":
            return ForcedFirstCall(own(flag(argv, "--generation.backend", "relay"), policy), tok)
        paired = Paired(own("relay", policy), own("hf", policy), tok.eos_token_id)
        return ForcedFirstCall(paired, tok) if sampler == "paired-tools" else paired

    kwargs = {"generator_factory": factory}
    if spec["stage"] == "ppo":
        kwargs["reward_fn"] = distrun.scripted_reward
    return kwargs


def flag(argv: list[str], name: str, default: str = "") -> str:
    """The last value `argv` gives `name` (as the config loader reads it), else `default`."""
    at = [i for i, a in enumerate(argv) if a == name]
    return argv[at[-1] + 1] if at else default


distrun.stage_class, distrun.stage_kwargs = stage_class, stage_kwargs

if __name__ == "__main__":
    distrun.run_all(json.loads(Path(sys.argv[1]).read_text()))
