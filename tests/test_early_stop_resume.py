"""An early-stopped run is finished: rerunning it, or resuming it after a stop at the step where it
stopped early, trains no further step (the checkpoint held the verdict, `EarlyStopping.stopped`;
a rerun trained one more step each time and overwrote merged/)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state, sft_args, write_sft  # noqa: F401 (autouse fixture)

from pipeline.engine.tracking import EarlyStopping
from stages.sft import SFTStage

EARLY = [
    "--train.eval_steps",
    "1",
    "--train.early_stopping_stall_num",
    "1",
    "--train.learning_rate",
    "0.08",
    "--train.max_steps",
    "12",
    "--train.divergence.enabled",
    "false",
]


def test_the_verdict_rides_in_the_state():
    early = EarlyStopping(patience=2)
    assert not early.update(1.0) and not early.update(1.5) and early.update(1.2)
    again = EarlyStopping(patience=2)
    again.load_state_dict(early.state_dict())
    assert again.stopped and not EarlyStopping(patience=0).stopped


def test_an_early_stopped_run_stays_stopped_when_rerun_or_resumed(tiny_model_dir, tmp_path, monkeypatch):
    train, valid = write_sft(tmp_path / "data", big=6, small=6)
    full = run_stage(SFTStage, sft_args(tiny_model_dir, train, valid, tmp_path / "full", *EARLY))
    assert full.step < 12 and full.early.stopped
    weights = load_file(tmp_path / "full" / "merged" / "model.safetensors")
    rerun = run_stage(SFTStage, sft_args(tiny_model_dir, train, valid, tmp_path / "full", *EARLY))
    assert rerun.step == full.step
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", str(full.step))
    cut = run_stage(SFTStage, sft_args(tiny_model_dir, train, valid, tmp_path / "cut", *EARLY))
    assert cut.step == full.step and not (tmp_path / "cut" / "merged").exists()
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    resumed = run_stage(SFTStage, sft_args(tiny_model_dir, train, valid, tmp_path / "cut", *EARLY))
    assert resumed.step == full.step
    for folder in ("full", "cut"):
        got = load_file(tmp_path / folder / "merged" / "model.safetensors")
        assert all(torch.equal(got[k], weights[k]) for k in weights), folder
