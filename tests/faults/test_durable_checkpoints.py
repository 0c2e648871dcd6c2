"""Checkpoints are durable (issue 12, points 2 and 4): every file is fsynced before the marker and
the directory after the rename; a marked checkpoint that fails to load is reported by name, moved
aside, and the previous one is used (the run then ends exactly as an unbroken one); a crash's
staging folder is cleaned at start-up with a warning; a full disk is one line naming the folder
and the space needed, with the previous checkpoint intact and nothing left to block the restart;
PPO checkpoints before its export, so a failed export does not re-run the stage."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch
from safetensors.torch import load_file
from test_pt_sft import fresh_accelerate_state, run_sft, sft_args, write_sft  # noqa: F401 (autouse fixture)

from pipeline.config import CheckpointConfig, KeepPolicy
from pipeline.engine import checkpoint as ck
from pipeline.engine.checkpoint import MARKER, Checkpointer, CheckpointError, complete_checkpoints
from pipeline.engine.stage_main import main


def state(step):
    return {
        "model": {"w": torch.full((64, 64), float(step))},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]},
        "trainer": {"step": step},
        "rng": ck.rng_state(),
    }


def test_files_are_fsynced_before_the_marker_and_the_folder_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(
        os, "rename", lambda a, b: (events.append(("rename", os.path.basename(b))), real_rename(a, b))[1]
    )
    root = tmp_path / "checkpoints"
    Checkpointer(root, CheckpointConfig()).save(3, state(3), lifetime="permanent")
    synced = [name for kind, name in events if kind == "fsync"]
    marker_at = synced.index(MARKER)
    written = {p.name for p in (root / "step-0000003").iterdir()} - {MARKER}
    assert written == {"model.safetensors", "optimizer.pt", "trainer.json", "rng-rank0.json"}
    assert written <= set(synced[:marker_at])  # every file flushed before the marker is written
    rename_at = events.index(("rename", "step-0000003"))
    assert ("fsync", "checkpoints") in events[rename_at:]  # the directory entry made durable


@pytest.mark.parametrize("damage", ["truncate model.safetensors", "truncate optimizer.pt", "zero model.safetensors"])
def test_a_marked_but_damaged_checkpoint_is_moved_aside_and_the_previous_one_resumes(
    damage, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    train, valid = write_sft(tmp_path / "data", 10, 4)
    args = ["--train.max_steps", "6", "--train.eval_steps", "0", "--checkpoint.keep", "[{every: 2}]"]
    unbroken = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "a", *args))
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "4")
    run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "b", *args))
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    newest = tmp_path / "b" / "checkpoints" / "step-0000004"
    action, name = damage.split()
    file = newest / name
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if action == "truncate" else data[:-64] + bytes(64))  # the marker stays
    with caplog.at_level(logging.WARNING):
        resumed = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "b", *args))
    assert f"{newest}: {name}" in caplog.text and "moved it aside" in caplog.text
    assert [r["step"] for r in resumed.history.steps] == list(range(1, 7)) and len(
        resumed.batch_ids
    ) == 4  # from step 2
    assert [r["train/loss"] for r in resumed.history.steps] == [r["train/loss"] for r in unbroken.history.steps]
    (aside,) = (tmp_path / "b" / "checkpoints.corrupt").iterdir()
    assert aside.name.startswith("step-0000004-")


def test_a_crashs_staging_folder_and_a_torn_step_folder_are_cleaned_with_a_warning(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    good = Checkpointer(root, CheckpointConfig()).save(2, state(2), lifetime="permanent")
    (root / ".staging-step-0000004").mkdir()
    (root / "step-0000005").mkdir()
    with caplog.at_level(logging.WARNING):
        assert Checkpointer(root, CheckpointConfig()).resume_path() == good
    assert "staging folder of a save that did not finish" in caplog.text and "has no .complete marker" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["step-0000002"]


def test_retention_keeps_the_previous_checkpoint_when_the_new_one_does_not_check_out(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    saver = Checkpointer(root, CheckpointConfig())
    first = saver.save(1, state(1), lifetime="temporary")
    monkeypatch.setattr(Checkpointer, "verify", lambda self, path: f"{path}: model.safetensors is damaged")
    saver.save(2, state(2), lifetime="temporary")
    assert first.is_dir() and [p.name for p in complete_checkpoints(root)] == ["step-0000001", "step-0000002"]


def enospc_on(call: int):
    """A torch.save that fails with ENOSPC on its `call`-th use in the checkpoint module."""
    real, calls = torch.save, {"n": 0}

    def save(obj, f, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            with open(f, "wb") as out:
                out.write(b"x" * 100)  # a partial file, as a real full disk leaves
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *args, **kwargs)

    return save


def test_disk_full_is_one_line_and_the_restart_continues(tiny_model_dir, tmp_path, monkeypatch, capsys):
    train, valid = write_sft(tmp_path / "data", 10, 4)
    out = tmp_path / "sft"
    argv = sft_args(
        tiny_model_dir,
        train,
        valid,
        out,
        "--train.max_steps",
        "6",
        "--train.eval_steps",
        "0",
        "--checkpoint.keep",
        "[{every: 2}]",
        "--tracking.trackers",
        "[]",
    )
    from stages.sft import SFTStage

    monkeypatch.setattr(ck.torch, "save", enospc_on(3))  # step 2 saves optimizer + scheduler; step 4's optimizer fails
    assert main(SFTStage, argv) == 1
    printed = capsys.readouterr().err
    err = [line for line in printed.splitlines() if line.strip() and "%|" not in line]  # tqdm's bar aside
    assert len(err) == 1 and "Traceback" not in printed
    assert err[0].startswith("sft: no space left on device: checkpoint step 4 needs about ")
    assert (
        f"in {out / 'checkpoints'}" in err[0]
        and f"the previous checkpoint {out / 'checkpoints' / 'step-0000002'} is intact" in err[0]
    )
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000002"]  # no staging folder left
    assert load_file(str(out / "checkpoints" / "step-0000002" / "model.safetensors"))
    monkeypatch.undo()
    stage = run_sft(argv)
    assert stage.step == 6 and len(stage.batch_ids) == 4 and (out / "merged" / "manifest.json").is_file()


def test_too_little_free_space_is_found_before_writing(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    usage = ck.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(
        CheckpointError,
        match=r"no space left on device: checkpoint step 1 needs about [0-9.]+ MB in .*, 0\.0 MB free; "
        r"there is no earlier checkpoint",
    ):
        Checkpointer(root, CheckpointConfig(keep=[KeepPolicy(every=1)])).save(1, state(1), lifetime="permanent")
    assert list(root.iterdir()) == []


def test_ppo_checkpoints_before_its_export(tiny_model_dir, tiny_reward_dir, tmp_path, monkeypatch):
    """An export that fails leaves the final step's checkpoint; the rerun trains no step again."""
    import json

    from stagerun import run_stage

    from stages import ppo

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question number {i}?"}) + "\n" for i in range(8)))
    cfg = ppo.PPOConfig(output_dir=str(tmp_path / "ppo"))
    cfg.model.path, cfg.reward_model.path = str(tiny_model_dir), str(tiny_reward_dir)
    cfg.data.train, cfg.data.eval = [str(prompts)], []
    cfg.train.max_steps, cfg.train.eval_steps, cfg.train.batch_size, cfg.lora.r = 2, 0, 4, 4
    cfg.generation.max_new_tokens, cfg.tracking.trackers = 4, []

    def broken_export(self, summary):
        raise OSError("the merge failed")

    monkeypatch.setattr(ppo.PPOStage, "export", broken_export)
    with pytest.raises(OSError):
        run_stage(ppo.PPOStage, cfg)
    assert [p.name for p in complete_checkpoints(tmp_path / "ppo" / "checkpoints")] == ["step-0000002"]
    monkeypatch.undo()
    steps = []
    stage = run_stage(ppo.PPOStage, cfg, on_step=lambda st, m: steps.append(st.step))
    assert steps == [] and stage.step == 2 and (tmp_path / "ppo" / "merged" / "manifest.json").is_file()


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs (skipped where this process may not mount one)."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(
        ["umount", "--lazy", str(mount)], capture_output=True
    )  # lazy: a reader still mapping a file must not keep it mounted


@pytest.mark.parametrize("precheck", [True, False])
def test_a_really_full_disk(small_disk, monkeypatch, precheck):
    """On a real small disk: with the size check, the second checkpoint is refused before writing;
    without it (a state larger on disk than estimated), the write itself fails (torch reports a
    short write as 'unexpected pos') and is still reported as a full disk. Either way the first
    checkpoint is intact and resumable, and no staging folder is left."""
    root = small_disk / "checkpoints"
    big = {
        "model": {"w": torch.ones(400, 400)},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(400, 400)}}, "param_groups": []},
        "trainer": {"step": 1},
    }
    saver = Checkpointer(root, CheckpointConfig())
    first = saver.save(1, big, lifetime="temporary")
    if not precheck:
        monkeypatch.setattr(ck, "state_bytes", lambda state: 0)
    with pytest.raises(
        CheckpointError,
        match=f"no space left on device: checkpoint step 2 needs about .* in {root}, .* free; "
        f"the previous checkpoint {first} is intact",
    ):
        saver.save(2, {**big, "trainer": {"step": 2}}, lifetime="temporary")
    assert [p.name for p in root.iterdir()] == ["step-0000001"]
    loaded = Checkpointer(root, CheckpointConfig()).load(Checkpointer(root, CheckpointConfig()).resume_path())
    assert loaded["trainer"] == {"step": 1}
