"""The stage registry (stages/__init__.py STAGES) states facts the driver, the report, the CLI and
the capability table read without importing a stage; the stage classes state the same facts in
code. Nothing else checks that the two agree, so this does, for every registered stage: a new
stage whose StageInfo line says otherwise than its class fails here, by name."""

from __future__ import annotations

import dataclasses

import pytest

from stages import STAGES, stage_class

DATA_KINDS = {"text", "chat", "preference", "prompt", "unpaired"}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_registry_line_agrees_with_the_stage_class(name):
    from pipeline.rl.policy_stage import PolicyStage

    info, cls = STAGES[name], stage_class(name)
    assert cls.name == name, f"{info.target}: class name {cls.name!r} is registered as {name!r}"
    assert cls.model_kind == info.model_kind, (
        f"{name}: StageInfo.model_kind {info.model_kind!r}, class {cls.model_kind!r}"
    )
    assert issubclass(cls, PolicyStage) == info.samples, (
        f"{name}: StageInfo.samples {info.samples}, PolicyStage subclass {issubclass(cls, PolicyStage)}"
    )
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    reads_rm = "reward_model" in fields
    assert (info.reward_model != "none") == reads_rm, (
        f"{name}: StageInfo.reward_model {info.reward_model!r}, config "
        f"{'has' if reads_rm else 'has no'} a reward_model section"
    )
    assert info.data_kind in DATA_KINDS, f"{name}: data_kind {info.data_kind!r}"
    assert all(parent in STAGES for parent in info.parents), f"{name}: parents {info.parents}"
