"""Checkpointer: keep policy, time-based temporaries with an injected clock, atomic saves, resume."""

import json
import random

import numpy as np
import pytest
import torch

from pipeline.config import CheckpointConfig, KeepPolicy
from pipeline.engine.checkpoint import (
    MARKER,
    Checkpointer,
    complete_checkpoints,
    keep_checkpoint,
    rng_state,
    set_rng_state,
)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_keep_policy_levanter_example():
    keep = [KeepPolicy(1000, 10000), KeepPolicy(5000, 40000), KeepPolicy(10000, None)]
    kept = [s for s in range(0, 70001, 1000) if keep_checkpoint(s, keep)]
    assert kept[:10] == list(range(1000, 10001, 1000))
    assert kept[10:16] == [15000, 20000, 25000, 30000, 35000, 40000]
    assert kept[16:] == [50000, 60000, 70000]
    assert not keep_checkpoint(0, keep) and not keep_checkpoint(1500, keep)


def state(step):
    return {
        "model": {"w": torch.full((2, 3), float(step))},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]},
        "trainer": {"step": step},
        "data": {"epoch": 0, "position": step},
        "rng": rng_state(),
    }


def test_temporary_checkpoints_by_time_and_previous_deleted(tmp_path):
    clock = Clock()
    ck = Checkpointer(tmp_path, CheckpointConfig(save_interval="10s", keep=[KeepPolicy(every=4)]), clock=clock)
    assert ck.due(1) is None
    clock.now = 10.0
    assert ck.due(1) == "temporary"
    first = ck.save(1, state(1), lifetime="temporary")
    clock.now = 15.0
    assert ck.due(2) is None
    clock.now = 21.0
    ck.save(3, state(3), lifetime=ck.due(3))
    assert not first.exists()  # the previous temporary one is gone once the new one landed
    assert ck.due(4) == "permanent"  # keep policy wins even when time is not up
    ck.save(4, state(4), lifetime="permanent")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-0000004"]  # temp 3 deleted
    clock.now = 40.0
    ck.save(5, state(5), lifetime="temporary")
    ck.save(6, state(6), lifetime="temporary")
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-0000004", "step-0000006"]


def test_roundtrip_and_torn_checkpoint_ignored(tmp_path):
    ck = Checkpointer(tmp_path, CheckpointConfig())
    good = ck.save(2, state(2), lifetime="permanent")
    torn = tmp_path / "step-0000009"
    torn.mkdir()
    (torn / "trainer.json").write_text(json.dumps({"step": 9}))
    assert ck.resume_path() == good
    loaded = ck.load(good)
    assert torch.equal(loaded["model"]["w"], torch.full((2, 3), 2.0))
    assert loaded["trainer"] == {"step": 2} and loaded["data"]["position"] == 2
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.1
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        ck.load(torn)
    assert not any(p.name.startswith(".staging") for p in tmp_path.iterdir())


def test_explicit_path_and_resume_false_moves_old_run_aside(tmp_path):
    root = tmp_path / "checkpoints"
    ck = Checkpointer(root, CheckpointConfig())
    saved = ck.save(3, state(3), lifetime="permanent")
    assert Checkpointer(root, CheckpointConfig(resume=str(saved))).resume_path() == saved
    with pytest.raises(FileNotFoundError):
        Checkpointer(root, CheckpointConfig(resume=str(root / "step-0000001"))).resume_path()
    fresh = Checkpointer(root, CheckpointConfig(resume=False))
    assert fresh.resume_path() is None
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoints.old-")]
    assert len(aside) == 1 and (aside[0] / "step-0000003" / MARKER).is_file()
    assert complete_checkpoints(root) == []


def test_rng_state_roundtrip_through_json():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    saved = json.loads(json.dumps(rng_state()))
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    set_rng_state(saved)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])
