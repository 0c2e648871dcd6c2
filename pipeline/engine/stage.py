"""The stage engine: `Stage` owns the flow every stage follows, a stage subclass supplies only
what is its own (ARCHITECTURE.md lists exactly what).

    validate -> build -> resume -> loop (train_step, end-of-step bookkeeping) -> complete
                                                 (final eval, checkpoint, export, summary)

- validate: every config problem (the config's own, the stage's `problems`, missing data files,
  the parent model's manifest), then the tokenizer and `build_data`, whose problems are reported
  together; nothing heavy has loaded yet.
- build: accelerator, seed, `build_model`, optimizer, `prepare`, scheduler, checkpointer, tracker.
- resume: the newest complete checkpoint (or checkpoint.resume's path): trainable weights,
  optimizer, scheduler, RNG, data cursor, step, early stopping, history and the stage's own
  `state_dict`.
- after every optimizer step: evaluate every `train.eval_steps` (an `eval/loss` feeds early
  stopping), checkpoint by the keep policy / save interval, and honour RELAY_STOP_AFTER_STEP=k
  (save right after step k and stop: how the resume tests stop a run at an exact step).
- complete: the final evaluation, a final checkpoint, `export` (adapter + merged/ with its
  manifest), summary.json.

`main(StageClass)` is every stage script's entry point.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from tqdm.auto import tqdm

from data_formats.sampling import DataCursor, epoch_tail, next_micro_batches
from pipeline.config import ConfigError, StageConfig, load_config, save_config, to_dict
from pipeline.engine.tracking import EarlyStopping, History

log = logging.getLogger(__name__)

STOP_ENV = "RELAY_STOP_AFTER_STEP"
OnStep = Callable[["Stage", dict], None]


# ------------------------------------------------------------------------------------------
# Checks every stage makes before anything heavy loads
# ------------------------------------------------------------------------------------------


def data_problems(entries: Sequence[str], key: str) -> list[str]:
    """Data path entries that name no file (a missing path or an empty folder/glob)."""
    from data_formats.sources import expand_entry

    out = []
    for entry in entries:
        files, dataset = expand_entry(entry)
        if dataset is None and (not files or not all(f.is_file() for f in files)):
            out.append(f"{key}: {entry!r} names no data file")
    return out


def parent_problems(model_path: str, need: str = "causal") -> list[str]:
    """What keeps model.path from loading as a `need` model (pipeline.modeling.preflight: missing,
    an adapter or reward-model folder, no weights/tokenizer, an unreachable hub id), then
    mismatches between a local parent model's manifest and its folder's tokenizer/template."""
    from pipeline.modeling.manifest import check_parent_compatible, read_manifest
    from pipeline.modeling.preflight import model_problems

    found = model_problems(model_path, "model.path", need=need)
    folder = Path(model_path)
    if found or not folder.is_dir() or read_manifest(folder) is None:
        return found
    return [f"model.path: {p}" for p in check_parent_compatible(folder, folder)]


def launched_world_size() -> int:
    """Processes torchrun started (WORLD_SIZE), known before the accelerator exists (validation)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def stop_after_step() -> Optional[int]:
    """The step from RELAY_STOP_AFTER_STEP (see the module docstring), or None.

    Raises:
        ValueError: the variable is set but not an integer.
    """
    text = os.environ.get(STOP_ENV, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError as err:
        raise ValueError(f"{STOP_ENV}={text!r} is not a step number") from err


def hide_unrequested_backends(cfg: StageConfig) -> None:
    """Keep DeepSpeed and bitsandbytes unloaded unless the config asks for them.

    accelerate, transformers and peft import each of them on sight when it is installed (DeepSpeed
    then prints "Setting accelerator to CPU", bitsandbytes its kernel hints) even for a plain LoRA
    run. A `None` entry in sys.modules, set before anything imports them, makes
    `importlib.util.find_spec` report the package missing, so those libraries skip it. A process
    that already imported a package (a test session) is left as it is.
    """
    for package, wanted in (("deepspeed", cfg.distributed.engine == "deepspeed"), ("bitsandbytes", cfg.model.finetuning == "qlora")):
        if not wanted and package not in sys.modules:
            sys.modules[package] = None


def write_summary(output_dir: str | Path, summary: dict) -> None:
    """Write `<output_dir>/summary.json` (the stage's headline figures)."""
    path = Path(output_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=float) + "\n", encoding="utf-8")


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class Stage:
    """One training stage. Subclasses set the class attributes and override the methods under
    "what a stage provides"; the flow methods below them are the engine's."""

    name: ClassVar[str] = ""
    """The stage's name: its manifest's `stage`, its run names, its registry key."""
    config_class: ClassVar[type] = StageConfig
    model_kind: ClassVar[str] = "causal"
    """How model.path is loaded and merged: 'causal' or 'reward'."""
    evaluates_at_start: ClassVar[bool] = False
    """Evaluate once before the first step (a baseline for the curves)."""

    def __init__(self, cfg: StageConfig):
        from pipeline.modeling.models import resolve_model_path

        self.cfg = cfg
        self.model_path = resolve_model_path(cfg.model.path)
        self.step = 0
        self.cursor = DataCursor()
        self.history = History()
        self.early = EarlyStopping(patience=cfg.train.early_stopping_stall_num)
        self.last_saved = -1
        self.tokenizer: Any = None
        self.chat_template: Optional[str] = None
        """Saved into merged/ (role_markers mode); None keeps the tokenizer's own."""
        self.train_samples: list = []
        self.eval_samples: list = []
        self.tasks: list[str] = ["default"]
        self.accelerator: Any = None
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.checkpointer: Any = None
        self.tracker: Any = None
        self.final_summary: Optional[dict] = None
        """summary.json's figures, once the stage completed."""

    # ---- what a stage provides -----------------------------------------------------------

    def problems(self) -> list[str]:
        """Config problems of this stage's own, found before anything loads."""
        return []

    def build_data(self) -> list[str]:
        """Read and tokenize the data (self.tokenizer is loaded): set train_samples, eval_samples,
        tasks, chat_template. Returns problems found in the built data.

        Raises:
            DataError / ValueError: bad records (reported as config problems).
        """
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        """The trainable module (self.accelerator exists; the seed is set)."""
        from pipeline.modeling.models import load_model

        return load_model(self.cfg.model, self.cfg.lora, kind=self.model_kind, tokenizer=self.tokenizer)

    def train_mode(self) -> None:
        """Put the prepared model in train mode (transformers checkpoints only layers in train mode)."""
        self.model.train()

    def train_step(self) -> dict[str, float]:
        """One optimizer step; returns its figures keyed by tracker tag (`train/loss`, ...).

        Raises:
            NonFiniteError: a non-finite loss or gradient (before the optimizer steps on it).
        """
        raise NotImplementedError

    def evaluate(self) -> Optional[dict[str, float]]:
        """Held-out figures keyed by tracker tag (`eval/loss` feeds early stopping); None without
        held-out data."""
        return None

    def state_dict(self) -> dict:
        """The stage's own state a resumed run needs (JSON-able)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""

    def before_export(self) -> None:
        """Last work on the trained model before it is exported (the RM's reward statistics)."""

    def manifest_extras(self) -> dict:
        """Extra keys for merged/manifest.json."""
        return {}

    def export(self, summary: dict) -> Optional[Path]:
        """Save the trained weights and merged/ (rank 0 returns it). Releases model, optimizer
        and scheduler first, so the merge does not hold the training copies too."""
        from pipeline.engine.export import export_trained

        return export_trained(self, {"tasks": self.tasks, "summary": summary, **self.manifest_extras()})

    def summary(self) -> dict:
        """summary.json's figures."""
        return self.history.summary()

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows after a step."""
        return {"loss": f"{figures['train/loss']:.4f}"} if "train/loss" in figures else {}

    # ---- the flow --------------------------------------------------------------------------

    @property
    def is_main(self) -> bool:
        return self.accelerator is None or self.accelerator.is_main_process

    def run(self, on_step: Optional[OnStep] = None) -> bool:
        """validate -> build -> resume -> loop -> complete. False when stopped by
        RELAY_STOP_AFTER_STEP (after saving); `on_step(stage, record)` runs after every step."""
        hide_unrequested_backends(self.cfg)
        self.validate()
        self.build()
        self.resume()
        if not self.loop(on_step):
            return False
        self.complete()
        return True

    def validate(self) -> None:
        """Every problem at once, before any model loads (see the module docstring).

        Raises:
            ConfigError: listing every problem found.
        """
        from data_formats.sources import DataError
        from pipeline.modeling.models import load_tokenizer

        cfg = self.cfg
        problems = cfg.problems() + self.problems()
        problems += data_problems(cfg.data.train, "data.train") + data_problems(cfg.data.eval, "data.eval")
        problems += parent_problems(self.model_path)
        if problems:
            raise ConfigError(problems)
        self.tokenizer = load_tokenizer(self.model_path, cfg.model.trust_remote_code, cfg.model.revision)
        try:
            problems = self.build_data()
        except (DataError, ValueError) as err:
            raise ConfigError([str(err)]) from err
        if problems:
            raise ConfigError(problems)

    def build(self) -> None:
        """Accelerator, seed, model, optimizer, scheduler, checkpointer, tracker; config.yaml."""
        from accelerate.utils import set_seed

        from pipeline.engine.checkpoint import Checkpointer
        from pipeline.engine.accelerator import build_optimizer, setup_accelerator
        from pipeline.engine.schedule import build_scheduler
        from pipeline.engine.tracking import Tracker, default_run_name

        cfg, out = self.cfg, Path(self.cfg.output_dir)
        self.accelerator = acc = setup_accelerator(cfg)
        set_seed(cfg.train.seed)  # LoRA's init and a fresh reward head draw from it
        model = self.build_model()
        self.model, self.optimizer = acc.prepare(model, build_optimizer(model, cfg.train))
        self.train_mode()
        # Not prepared: accelerate would step it once per process per step.
        self.scheduler = build_scheduler(getattr(self.optimizer, "optimizer", self.optimizer), cfg.train)
        self.checkpointer = Checkpointer(out / "checkpoints", cfg.checkpoint, rank=acc.process_index,
                                         world_size=acc.num_processes, barrier=acc.wait_for_everyone)
        self.tracker = Tracker(cfg.tracking, out, default_run_name(self.name), to_dict(cfg), enabled=acc.is_main_process)
        if self.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, out / "config.yaml")
        tail = epoch_tail(len(self.train_samples), cfg.train.batch_size, acc.num_processes) if self.train_samples else 0
        if tail:
            log.info("%d training sample(s) per epoch do not fill a global micro-batch and sit out that epoch "
                     "(each epoch reshuffles, so a different %d)", tail, tail)

    def checkpoint_state(self) -> dict:
        """Every part of a checkpoint (see the module docstring)."""
        from pipeline.engine.checkpoint import rng_state, trainable_state

        return {
            "model": trainable_state(self.model, self.accelerator),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "data": asdict(self.cursor),
            "trainer": {"step": self.step, "early_stopping": self.early.state_dict(), "history": self.history.state_dict(),
                        "stage": self.state_dict()},
        }

    def resume(self) -> None:
        """Load the checkpoint to resume from, if any.

        Raises:
            KeyError: the checkpoint does not match the model or lacks a part.
            FileNotFoundError: a bad checkpoint.resume path.
        """
        from pipeline.engine.checkpoint import load_trainable_state, set_rng_state

        path = self.checkpointer.resume_path()
        if path is None:
            return
        state = self.checkpointer.load(path)
        load_trainable_state(self.model, state["model"], self.accelerator)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.cursor = DataCursor(**state["data"])
        trainer = state["trainer"]
        self.step = self.last_saved = int(trainer["step"])
        self.early.load_state_dict(trainer["early_stopping"])
        self.history.load_state_dict(trainer["history"])
        self.load_state_dict(trainer["stage"])
        if "rng" in state:
            set_rng_state(state["rng"])
        else:
            log.warning("the checkpoint has no RNG state for this rank: sampling will differ from an unbroken run")
        log.info("resumed from %s at step %d", path, self.step)

    def loop(self, on_step: Optional[OnStep] = None) -> bool:
        """Train until train.max_steps; False when RELAY_STOP_AFTER_STEP stopped the run."""
        t = self.cfg.train
        stop_at = stop_after_step()
        if self.evaluates_at_start and self.step == 0:
            self.run_evaluation()
        bar = tqdm(total=t.max_steps, initial=self.step, desc=self.name, disable=not self.accelerator.is_local_main_process)
        try:
            while self.step < t.max_steps:
                lr = self.scheduler.get_last_lr()[0]
                figures = self.train_step()
                self.scheduler.step()
                self.step += 1
                record = {"step": self.step, "train/lr": lr, **figures}
                self.history.steps.append(record)
                if self.step % t.log_steps == 0 or self.step == t.max_steps:
                    self.tracker.log(figures | {"train/lr": lr}, self.step)
                bar.update(1)
                bar.set_postfix(self.progress(figures))
                if on_step is not None:
                    on_step(self, record)
                outcome = self.end_of_step(stop_at)
                if outcome == "interrupted":
                    return False
                if outcome == "early_stop":
                    break
        finally:
            bar.close()
        if not self.history.evals or self.history.evals[-1]["step"] != self.step:
            self.run_evaluation()
        return True

    def run_evaluation(self) -> Optional[dict]:
        """Evaluate, record and log at the current step; None without held-out data."""
        result = self.evaluate()
        if result is None:
            return None
        self.history.evals.append({"step": self.step, **result})
        self.tracker.log(result, self.step)
        return result

    def save_checkpoint(self, lifetime: str) -> Path:
        """Save the current step as a 'permanent' or 'temporary' checkpoint (every rank calls this)."""
        path = self.checkpointer.save(self.step, self.checkpoint_state(), lifetime=lifetime)
        self.last_saved = self.step
        return path

    def end_of_step(self, stop_at: Optional[int]) -> Optional[str]:
        """Evaluate when due, checkpoint when due, honour RELAY_STOP_AFTER_STEP.

        Returns "interrupted", "early_stop" or None (go on).
        """
        t = self.cfg.train
        stop = False
        if t.eval_steps and self.step % t.eval_steps == 0:
            result = self.run_evaluation()
            stop = bool(result and "eval/loss" in result and self.early.update(result["eval/loss"]))
        lifetime = self.checkpointer.due(self.step)
        if lifetime is not None:
            self.save_checkpoint(lifetime)
        if stop_at is not None and self.step == stop_at:
            if self.last_saved != self.step:
                self.save_checkpoint("temporary")
            log.warning("%s=%d: saved and stopping", STOP_ENV, stop_at)
            return "interrupted"
        if stop:
            log.info("early stopping at step %d (no better eval loss in %d evaluations)", self.step, t.early_stopping_stall_num)
            return "early_stop"
        return None

    def complete(self) -> Optional[Path]:
        """Final checkpoint, `before_export`, export, summary.json; returns merged/ on rank 0."""
        if self.last_saved != self.step:
            self.save_checkpoint("permanent")
        self.before_export()
        self.final_summary = summary = self.summary()
        merged = self.export(summary)
        if self.is_main:
            out = Path(self.cfg.output_dir)
            write_summary(out, summary)
            save_config(self.cfg, out / "config.yaml")
        self.tracker.close()
        self.accelerator.wait_for_everyone()
        return merged

    # ---- helpers subclasses share ------------------------------------------------------------

    def next_sample_indices(self, grad_accum: Optional[int] = None) -> list[list[int]]:
        """This rank's sample indices of the next optimizer step's micro-batches (advances the
        cursor; the order is a pure function of the seed, the epoch and the global batch)."""
        t, acc = self.cfg.train, self.accelerator
        groups, self.cursor = next_micro_batches(len(self.train_samples), self.cursor, seed=t.seed, batch_size=t.batch_size,
                                                 grad_accum=t.grad_accum if grad_accum is None else grad_accum,
                                                 world_size=acc.num_processes, rank=acc.process_index)
        return groups

    def collate(self, collator, samples: Sequence, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """One batch of `samples[indices]` on this rank's device."""
        return {k: v.to(self.accelerator.device) for k, v in collator([samples[i] for i in indices]).items()}


def main(stage_class: type[Stage], argv: Optional[Sequence[str]] = None) -> int:
    """Every stage script's entry point: parse the config, run the stage, print its summary.
    Config problems print as one list and exit 2."""
    logging.basicConfig(level=os.environ.get("RELAY_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prog = f"stages/{Path(inspect.getfile(stage_class)).name}"
    try:
        stage = stage_class(load_config(stage_class.config_class, argv, prog=prog))
        completed = stage.run()
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    if completed and stage.is_main:
        print(json.dumps(stage.final_summary, indent=2, default=float))
    return 0
