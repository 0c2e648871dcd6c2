"""Resuming a stage: which checkpoint a run may resume (its identity against this run's,
pipeline.engine.identity, checked in validation before any model loads), loading the newest one
that loads (falling back past broken ones, pipeline.engine.checkpoint), and putting its state
into the run: weights, optimizer, scheduler, RNG, the data cursor (it counts samples, so another
batch split or number of ranks goes on at the next unseen sample), the trainer's history and the stage's own state, and
the schedule when the resume changed the train settings."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from data_formats.sampling import legacy_cursor
from pipeline.config import ConfigError, to_dict
from pipeline.engine.accelerator import load_optimizer_state, load_trainable_state
from pipeline.engine.checkpoint import (
    MARKER,
    CheckpointError,
    CorruptCheckpoint,
    newest_identity,
    resume_setting,
    set_rng_state,
)
from pipeline.engine.identity import compare, run_identity
from pipeline.engine.interrupt import all_ranks_ok
from pipeline.engine.schedule import build_scheduler
from pipeline.engine.tracking import set_aside_events

log = logging.getLogger("pipeline.engine.stage")


def launched_world_size() -> int:
    """Processes torchrun started (WORLD_SIZE), known before the accelerator exists (validation)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resume_problems(stage) -> list[str]:
    """Compare the checkpoint this run would resume with this run's identity (module
    docstring of pipeline.engine.identity); sets `identity`, `accepted_changes` and
    `allowed_changes`."""
    cfg = stage.cfg
    stage.identity = run_identity(
        stage.name,
        to_dict(cfg),
        model_path=stage.model_path,
        world_size=launched_world_size(),
        may_change=stage.resume_may_change,
        training_data=stage.training_data(),
        models=stage.input_models(),
    )
    resume = resume_setting(cfg.checkpoint)
    if resume not in (True, False) and not (Path(resume) / MARKER).is_file():
        return [f"checkpoint.resume: {resume} is not a complete checkpoint (no {MARKER} marker)"]
    found = newest_identity(Path(cfg.output_dir) / "checkpoints", cfg.checkpoint)
    if found is None:
        return []
    path, saved = found
    impossible, refused, allowed = compare(saved, stage.identity)
    if impossible:
        return [
            f"{path}: cannot resume it: {d}; use another output_dir, or checkpoint.resume: false to move its "
            f"checkpoints aside and start fresh"
            for d in impossible
        ]
    if refused and not cfg.checkpoint.resume_changed:
        return [f"{path}: changed since this checkpoint: {d}" for d in refused] + [
            "checkpoint.resume_changed: true resumes with the new values (recorded in the manifest); "
            "checkpoint.resume: false starts fresh (the old checkpoints are moved aside)"
        ]
    for d in allowed:
        log.info("resuming %s with a changed %s", path, d)
    stage.accepted_changes, stage.allowed_changes = refused, allowed
    return []


def resume(stage) -> None:
    """Load the checkpoint to resume from, if any, falling back past ones that fail to load
    (each moved aside with a warning); apply the config changes validation accepted.

    Raises:
        CheckpointError: an explicit checkpoint.resume path that fails to load.
        ConfigError: the checkpoint's weights do not fit the model.
        FileNotFoundError: a bad checkpoint.resume path.
    """
    explicit = resume_setting(stage.cfg.checkpoint) not in (True, False)
    for path in stage.checkpointer.candidates():
        try:
            state, reason = stage.checkpointer.load(path), None
        except CorruptCheckpoint as err:
            state, reason = None, str(err)
        if not all_ranks_ok(state is not None, stage.accelerator):
            reason = reason or f"{path} failed to load on another rank"
            if explicit:
                raise CheckpointError(reason)
            stage.checkpointer.move_aside(path, reason)
            stage.accelerator.wait_for_everyone()
            continue
        restore(stage, state)
        log.info("resumed from %s at step %d", path, stage.step)
        return
    set_aside_curves(stage)


def set_aside_curves(stage) -> None:
    """A run that trains from step 0 (resume false, or no checkpoint to resume) moves the earlier
    runs' TensorBoard events in its output_dir aside, with their checkpoints' suffix, so its
    report's curves are this run's only (a resumed run keeps them: its curves continue them)."""
    earlier = getattr(stage, "earlier_events", [])
    if not earlier:
        return
    moved = getattr(stage.checkpointer, "aside", None)
    suffix = moved.name.partition(".old-")[2] if moved is not None else None
    aside = set_aside_events(stage.cfg.output_dir, earlier, suffix)
    if aside is not None:
        log.warning("this run starts at step 0: moved the previous run's TensorBoard events to %s", aside)


def restore(stage, state: dict) -> None:
    """Put a loaded checkpoint's state into the run (see `Stage.checkpoint_state`)."""
    try:
        load_trainable_state(stage.model, state["model"], stage.accelerator)
    except KeyError as err:
        raise ConfigError([f"the checkpoint's weights do not fit the model: {err.args[0]}"]) from None
    load_optimizer_state(stage.model, stage.optimizer, state["optimizer"], stage.accelerator)
    stage.scheduler.load_state_dict(state["scheduler"])
    trainer = state["trainer"]
    stage.step = stage.last_saved = int(trainer["step"])
    stage.cursor = legacy_cursor(state["data"], trainer.get("global_micro_batch"))
    stage.early.load_state_dict(trainer["early_stopping"])
    stage.history.load_state_dict(trainer["history"])
    stage.load_state_dict(trainer["stage"])
    stage.resume_changes = list(trainer.get("resume_changes", []))
    if "rng" in state:
        set_rng_state(state["rng"])
    else:
        log.warning("the checkpoint has no RNG state for this rank: sampling will differ from an unbroken run")
    if stage.accepted_changes:
        stage.resume_changes.append({"step": stage.step, "changes": stage.accepted_changes})
        log.warning(
            "resuming at step %d with changes accepted by checkpoint.resume_changed: %s",
            stage.step,
            "; ".join(stage.accepted_changes),
        )
    apply_schedule(stage)


def apply_schedule(stage) -> None:
    """Make the optimizer follow this run's train settings from the current step on when the
    resume changed them (learning rate, schedule, max_steps, AdamW's betas, eps, weight
    decay). Without such a change the restored state is left as it is (bit-identical)."""
    changed = [c.split(":")[0] for c in stage.accepted_changes + stage.allowed_changes]
    if not any(c.startswith("train.") for c in changed):
        return
    t = stage.cfg.train
    optimizer = getattr(stage.optimizer, "optimizer", stage.optimizer)
    groups = optimizer.param_groups
    for g in groups:
        g["initial_lr"], g["betas"], g["eps"] = t.learning_rate, (t.beta1, t.beta2), t.epsilon
        if any(p.ndim >= 2 for p in g["params"]):
            g["weight_decay"] = t.weight_decay
    scheduler = build_scheduler(optimizer, t)
    scheduler.last_epoch = stage.step
    lrs = [base * fn(stage.step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for g, lr in zip(groups, lrs):
        g["lr"] = lr
    scheduler._last_lr = lrs
    stage.scheduler = scheduler
