"""tests/distrun.py's runner with the runs tests/test_cells_ddp.py adds: the KTO and distill stages
(distill samples with distrun.ScriptedGenerator), and PPO / GRPO with tools sampled by
tests/tool_distrun.py's scripted caller (a pure function of each context, so the rollouts do not
depend on how prompts are dealt to ranks).

    torchrun --nproc_per_node 2 tests/cells_distrun.py RUNS.json

A spec's "sampler" may also be "tools"; everything else is tests/distrun.py's.
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


def stage_kwargs(spec: dict) -> dict:
    """tests/distrun.py's, or the scripted tool caller (PPO scored by distrun.scripted_reward)."""
    if spec["stage"] == "distill" and spec.get("sampler", "scripted") == "scripted":
        return {"generator_factory": lambda policy: distrun.ScriptedGenerator()}
    if spec.get("sampler") != "tools":
        return _stage_kwargs(spec)
    from tool_distrun import Scripted
    from transformers import AutoTokenizer

    argv = spec["argv"]
    tok = AutoTokenizer.from_pretrained(argv[argv.index("--model.path") + 1])
    kwargs = {"generator_factory": lambda policy: Scripted(tok)}
    if spec["stage"] == "ppo":
        kwargs["reward_fn"] = distrun.scripted_reward
    return kwargs


distrun.stage_class, distrun.stage_kwargs = stage_class, stage_kwargs

if __name__ == "__main__":
    distrun.run_all(json.loads(Path(sys.argv[1]).read_text()))
