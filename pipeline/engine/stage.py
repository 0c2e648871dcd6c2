"""The stage engine: `Stage` owns the flow every stage follows, a stage subclass supplies only
what is its own (ARCHITECTURE.md lists exactly what).

    validate -> build -> resume -> loop (train_step, end-of-step bookkeeping) -> complete
                                                 (final eval, checkpoint, export, summary)

- validate: every config problem (the config's own, the stage's `problems`, missing data files,
  the parent model's manifest), then the tokenizer and `build_data`, whose problems are reported
  together: the bad records of every split it reads (train, eval) in one list
  (data_formats.drops.collect_refusals); nothing heavy has loaded yet.
- build: accelerator, seed, `build_model`, optimizer, `prepare`, scheduler, checkpointer, tracker.
- resume: the newest complete checkpoint (or checkpoint.resume's path): trainable weights,
  optimizer, scheduler, RNG, data cursor, step, early stopping, history and the stage's own
  `state_dict`. Validation has already compared the checkpoint's identity with this run's
  (pipeline.engine.identity: another stage's folder, another model or LoRA shape, a changed
  config or data are refused, the last two unless checkpoint.resume_changed). A checkpoint that
  fails to load is moved aside and the previous one is used (pipeline.engine.checkpoint).
- after every optimizer step: check divergence (pipeline.engine.divergence), evaluate every
  `train.eval_steps` (an `eval/loss` feeds early stopping), checkpoint by the keep policy / save
  interval, stop on SIGTERM/SIGINT at this boundary on every rank with a checkpoint
  (pipeline.engine.interrupt), and honour RELAY_STOP_AFTER_STEP=k (save right after step k and
  stop: how the resume tests stop a run at an exact step).
- complete: the final evaluation, a final checkpoint, `export` (adapter + merged/ with its
  manifest), summary.json.

`main(StageClass)` is every stage script's entry point: every way a run ends early (bad config,
a signal, divergence, a non-finite loss, a checkpoint that cannot be written, a vLLM server that
died or never started) is one line on
stderr and an exit code (2 config, 128+N signal N, 1 otherwise), never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from data_formats.datasets import source_mix
from data_formats.drops import collect_refusals, overlong_drops
from data_formats.render import make_template, template_jinja
from data_formats.sampling import DataCursor, epoch_tail, next_micro_batches
from data_formats.sources import DataError
from data_formats.validate import data_problems, skip_report, take_skipped
from pipeline.config import ConfigError, StageConfig, save_config, to_dict
from pipeline.config.capabilities import config_refusals
from pipeline.config.engines import package_wanted, resumes, stop_advice
from pipeline.engine.accelerator import (
    combination_problems,
    frozen_zero3_engine,
    is_partitioned,
    optimizer_state,
    prepare_training,
    resolve_precision,
    setup_accelerator,
    torch_optimizer,
    trainable_state,
)
from pipeline.engine.checkpoint import Checkpointer, complete_checkpoints, rng_state
from pipeline.engine.divergence import Diverged, largest_weight, loss_divergence, weight_divergence
from pipeline.engine.export import export_trained
from pipeline.engine.held_out import eval_shards, held_out
from pipeline.engine.identity import TRAINING_DATA, data_digest, training_entries
from pipeline.engine.interrupt import (
    STOP_ENV,
    Stopped,
    StopRequest,
    agreed_signal,
    all_ranks_ok,
    ranks_max,
    signal_name,
)
from pipeline.engine.precision import fp32_masters, keeps_masters
from pipeline.engine.resume import launched_world_size, resume, resume_problems
from pipeline.engine.schedule import build_scheduler
from pipeline.engine.stage_checks import (
    early_stopping_problems,
    fill_problem,
    parent_problems,
    supervision_problems,
)
from pipeline.engine.steps import NonFiniteError, optimizer_step
from pipeline.engine.tracking import (
    EarlyStopping,
    History,
    Tracker,
    default_run_name,
    event_files,
)
from pipeline.modeling import models
from pipeline.modeling.adapter_checks import tied_lora_problems
from pipeline.modeling.embedded import EmbeddedError, resolve_model_path
from pipeline.modeling.onednn import onednn_linears

log = logging.getLogger(__name__)

OnStep = Callable[["Stage", dict], None]


# ------------------------------------------------------------------------------------------
# Checks every stage makes before anything heavy loads
# ------------------------------------------------------------------------------------------


def resolved_path(key: str, path: Optional[str]) -> str:
    """The model folder config `key` names ('embedded' converted once, pipeline.modeling.embedded).

    Raises:
        ConfigError: the embedded model cannot be converted here (one line naming `key`).
    """
    try:
        return resolve_model_path(path)
    except EmbeddedError as err:
        raise ConfigError([f"{key}: {err}"]) from err


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
    for package, wanted in (
        *package_wanted(cfg.distributed.engine).items(),  # the engines' own (pipeline/config/engines.py)
        ("bitsandbytes", cfg.model.finetuning == "qlora"),
    ):
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
    loss_can_diverge: ClassVar[bool] = True
    """`train/loss` is a loss that starts positive and should fall (LM, RM, DPO), so a climb to a
    multiple of its start means divergence (train.divergence). False for surrogate objectives
    that hover around 0 (GRPO); the weight check applies to every stage."""
    evaluates_loss: ClassVar[bool] = True
    """`evaluate` gives `eval/loss`, which train.early_stopping_stall_num watches. False where the
    held-out figures are rewards (PPO, GRPO): early stopping is refused there, not left idle."""
    resume_may_change: ClassVar[tuple[str, ...]] = ()
    """The stage's own config keys (dotted, or prefixes ending in '.') that may change on
    resume without refusal, beside pipeline.engine.identity.MAY_CHANGE."""

    def __init__(self, cfg: StageConfig):

        self.cfg = cfg
        self.model_path = resolved_path("model.path", cfg.model.path)
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
        self.frozen_engines: list = []
        """Under ZeRO-3, the DeepSpeed engines that gather `frozen_copies`' partitions."""
        self.earlier_events: list[Path] = []
        """TensorBoard event files in runs/ before this run's tracker opened (set aside on a fresh start)."""
        self.checkpointer: Any = None
        self.tracker: Any = None
        self.final_summary: Optional[dict] = None
        """summary.json's figures, once the stage completed."""
        self.stop_request = StopRequest()
        self.identity: Optional[dict] = None
        """What this run's checkpoints record (pipeline.engine.identity.run_identity)."""
        self.accepted_changes: list[str] = []
        """Differences from the resumed checkpoint that checkpoint.resume_changed accepted."""
        self.allowed_changes: list[str] = []
        """Differences from the resumed checkpoint that may change without refusal (logged)."""
        self.resume_changes: list[dict] = []
        """Every accepted change so far ({step, changes}); rides in checkpoints, ends in the manifest."""
        self.step_indices: list[list[int]] = []
        """The sample indices the current step drew (named when a step fails)."""
        self.skipped_records: dict = {}
        """What data.on_error=skip left out: {count, by_split: {split: {reason: count}}} (the manifest's)."""
        self.mix = None
        """The weighted mix of the training entries (data.weights; built with the fill check), else None."""
        self.mix_figures: dict = {}
        """The last step's samples and tokens per weighted entry (logged with the step's figures)."""

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

        return models.load_model(self.cfg.model, self.cfg.lora, kind=self.model_kind, tokenizer=self.tokenizer)

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
        held-out data. A stage evaluates through `held_out`."""
        return None

    def held_out(self, figures: Callable[[list[int]], dict]) -> dict[str, torch.Tensor]:
        """Each of `figures(indices)`'s sums over the held-out samples of every rank, in batches of
        train.batch_size, at most train.eval_batches of them: pipeline.engine.held_out, one rule
        for a short rank's padding batch."""
        acc, t = self.accelerator, self.cfg.train
        shards = eval_shards(len(self.eval_samples), t.batch_size, acc.num_processes, acc.process_index, t.eval_batches)
        return held_out(shards, figures, acc)

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

    def training_data(self) -> tuple[str, ...]:
        """The config keys whose files the steps train on: the run's identity (resume) and the
        manifest's `data_digest` (the pipeline's staleness) cover their files."""
        return TRAINING_DATA

    def input_models(self) -> dict[str, str]:
        """{config key: folder} of the other models the steps learn from (distill's teacher): a
        resumed run refuses their changed weights as it does a changed setting."""
        return {}

    def export(self, summary: dict) -> Optional[Path]:
        """Save the trained weights and merged/ (rank 0 returns it). Releases model, optimizer
        and scheduler first, so the merge does not hold the training copies too."""
        return export_trained(self, {"tasks": self.tasks, "summary": summary, **self.all_manifest_extras()})

    def export_module(self) -> torch.nn.Module:
        """The trained module `export` saves (PPO and GRPO: the policy inside their module)."""
        return self.accelerator.unwrap_model(self.model)

    def export_adapters(self) -> dict[str, torch.nn.Module]:
        """Further adapters `export` saves beside adapter/, by folder name (PPO's critic_adapter)."""
        return {}

    def frozen_copies(self) -> list[torch.nn.Module]:
        """The frozen models the stage runs beside the trained one (a full-weight reference, a
        reward model), none by default. Under ZeRO-3 they load partitioned, and `build` gives each
        a DeepSpeed engine that gathers its partitions in its forwards (`frozen_engines`)."""
        return []

    def release(self) -> None:
        """Drop what the stage holds on to besides model, optimizer and scheduler (a sampler, a
        reference copy) before export merges, so the merge does not hold them too."""

    def summary(self) -> dict:
        """summary.json's figures."""
        return self.history.summary()

    def run_figures(self) -> dict:
        """The figures every summary ends with: steps and wall time."""
        return {"steps": self.step, "wall_seconds": self.history.wall_seconds()}

    def data_template(self):
        """The chat template `cfg.data` asks for (data_formats.render.make_template); sets
        `chat_template`, which merged/ saves (role_markers mode)."""
        template = make_template(self.cfg.data, self.tokenizer)
        self.chat_template = template_jinja(template, self.tokenizer)
        return template

    def fill_problems(self, count: int, what: str, batch: str = "micro-batch") -> list[str]:
        """The one problem line when `count` training items cannot fill one batch on every rank,
        with the reason when records were dropped as overlong (stage_checks.fill_problem)."""
        self.mix = source_mix(self.cfg.data, self.train_samples, self.cfg.train.seed) if self.train_samples else None
        return fill_problem(
            count, what, batch, self.cfg.train.batch_size, launched_world_size(), overlong_drops("train"), self.mix
        )

    def all_manifest_extras(self) -> dict:
        """`manifest_extras` plus the engine's own: the config changes accepted on resume."""
        extras = self.manifest_extras()
        if self.skipped_records.get("count"):
            extras["skipped_records"] = self.skipped_records
        if self.resume_changes:
            extras["resume_changes"] = self.resume_changes
        if self.mix is not None:
            extras["data_mix"] = self.mix.describe()
        # what the weights were trained on (the files as this run found them at its start): the
        # pipeline calls the output stale when they change
        trained_on = (self.identity or {}).get("config", {}).get("data.train_files")
        keys = self.training_data()
        extras["data_digest"] = trained_on or data_digest(training_entries(to_dict(self.cfg), keys))
        extras["data_digest_keys"] = list(keys)
        return extras

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
        self.stop_request.install()
        try:
            self.validate()
            self.build()
            self.resume()
            if not self.loop(on_step):
                return False
            self.complete()
        finally:
            self.stop_request.uninstall()
        return True

    def validate(self) -> None:
        """Every problem at once, before any model loads (see the module docstring).

        Raises:
            ConfigError: listing every problem found.
        """
        cfg = self.cfg
        problems = cfg.problems() + self.problems() + combination_problems(cfg)
        problems += early_stopping_problems(cfg.train, cfg.data.has_eval, self.evaluates_loss)
        problems += [p for p in config_refusals(self.name, cfg) if p not in problems]  # the capability table
        problems += data_problems(cfg.data.train, "data.train") + data_problems(cfg.data.eval, "data.eval")
        # A reward stage may start from a causal LM (fresh head) or from a reward model.
        problems += parent_problems(
            self.model_path, "any" if self.model_kind == "reward" else "causal", cfg.model.allow_pickle
        )
        problems += models.remote_code_problems(cfg.model, "model")
        if cfg.model.finetuning != "full" and not problems:  # the folder's config is readable
            problems += tied_lora_problems(self.model_path, cfg.lora, self.model_kind, cfg.model.trust_remote_code)
        if not problems:
            problems += resume_problems(self)
        if problems:
            raise ConfigError(problems)
        self.tokenizer = models.load_tokenizer(self.model_path, cfg.model.trust_remote_code, cfg.model.revision)
        take_skipped()
        with collect_refusals() as refused:  # every split is read: train's and eval's problems together
            try:
                problems = self.build_data()
            except (DataError, ValueError) as err:
                raise ConfigError(([str(DataError(refused))] if refused else []) + [str(err)]) from err
        if refused:
            raise ConfigError([str(DataError(refused))])
        problems = self.record_skipped(take_skipped()) + problems
        problems = problems or supervision_problems(self.train_samples, cfg.train.seq_length)
        if cfg.train.early_stopping_stall_num and cfg.data.has_eval and not self.eval_samples:
            problems.append(
                "train.early_stopping_stall_num: no held-out sample to watch "
                f"(data.eval_fraction {cfg.data.eval_fraction} carved none off the training data)"
            )
        if problems:
            raise ConfigError(problems)

    def record_skipped(self, skipped: list) -> list[str]:
        """Write what data.on_error=skip left out to skipped_records.txt in the run folder and keep its
        counts for the manifest; returns the whole-file problems (a file with no good record)."""
        lines, self.skipped_records, fatal = skip_report(skipped)
        if lines and int(os.environ.get("RANK", "0")) == 0:
            Path(self.cfg.output_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.cfg.output_dir) / "skipped_records.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        return fatal

    def build(self) -> None:
        """Accelerator, seed, model, optimizer, scheduler, checkpointer, tracker; config.yaml."""

        cfg, out = self.cfg, Path(self.cfg.output_dir)
        self.accelerator = acc = setup_accelerator(cfg)
        set_seed(cfg.train.seed)  # LoRA's init and a fresh reward head draw from it
        model = self.build_model()
        if keeps_masters(cfg.train.precision, resolve_precision(cfg.train.precision)):
            fp32_masters(model)
        self.model, self.optimizer = prepare_training(acc, model, cfg)
        # Frozen copies ZeRO-3 partitioned as they loaded: their forwards need an engine of their own.
        self.frozen_engines = [frozen_zero3_engine(acc, m) for m in self.frozen_copies() if is_partitioned(m)]
        self.train_mode()
        # Not prepared: accelerate would step it once per process per step.
        self.scheduler = build_scheduler(torch_optimizer(self.optimizer), cfg.train)
        self.checkpointer = Checkpointer(
            out / "checkpoints",
            cfg.checkpoint,
            rank=acc.process_index,
            world_size=acc.num_processes,
            barrier=acc.wait_for_everyone,
            agree=lambda ok: all_ranks_ok(ok, acc),
        )
        # a fresh start moves these aside (pipeline.engine.resume); this run's own file is not among them
        self.earlier_events = event_files(out) if acc.is_main_process else []
        self.tracker = Tracker(
            cfg.tracking, out, default_run_name(self.name), to_dict(cfg), enabled=acc.is_main_process
        )
        if self.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, out / "config.yaml")
        # a weighted mix's epochs carry their rest over into the next one's draws (data_formats.sampling)
        tail = (
            epoch_tail(len(self.train_samples), cfg.train.batch_size, acc.num_processes)
            if self.train_samples and self.mix is None
            else 0
        )
        if tail:
            log.info(
                "%d training sample(s) per epoch do not fill a global micro-batch and sit out that epoch "
                "(each epoch reshuffles, so a different %d)",
                tail,
                tail,
            )

    def checkpoint_state(self) -> dict:
        """Every part of a checkpoint (see the module docstring)."""

        return {
            "model": trainable_state(self.model, self.accelerator),
            "optimizer": optimizer_state(self.model, self.optimizer, self.accelerator),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "data": asdict(self.cursor),
            "trainer": {
                "step": self.step,
                "early_stopping": self.early.state_dict(),
                "history": self.history.state_dict(),
                "stage": self.state_dict(),
                "resume_changes": self.resume_changes,
                "global_micro_batch": self.cfg.train.batch_size * self.accelerator.num_processes,
            },
        }

    def resume(self) -> None:
        """Load the checkpoint to resume from, if any (pipeline.engine.resume.resume)."""
        resume(self)

    def linear_models(self) -> list:
        """The models whose linear layers `fast_linears` switches (the trained one; stages with
        frozen copies outside it add them)."""
        return [self.accelerator.unwrap_model(self.model)]

    def fast_linears(self):
        """Train steps and evaluations run their linear layers on oneDNN's fp32 kernel on a CPU
        where it pays (`pipeline.modeling.onednn.onednn_linears`: ~2.2x MKL's GEMM on the reference
        AMD CPU with AVX-512, nothing on AVX2 or an Intel CPU; chosen by `cpu_kernels.choice`, the
        same fp32 math; RELAY_CPU_ONEDNN=1/0 forces it); a no-op on a GPU or in another dtype."""
        return onednn_linears(*self.linear_models())

    def loop(self, on_step: Optional[OnStep] = None) -> bool:
        """Train until train.max_steps; False when RELAY_STOP_AFTER_STEP stopped the run."""
        t = self.cfg.train
        stop_at = stop_after_step()
        if self.evaluates_at_start and self.step == 0:
            self.run_evaluation()
        bar = tqdm(
            total=t.max_steps, initial=self.step, desc=self.name, disable=not self.accelerator.is_local_main_process
        )
        try:
            self.check_stop_request()
            while self.step < t.max_steps and not self.early.stopped:  # a resumed run may have stopped early
                lr = self.scheduler.get_last_lr()[0]
                try:
                    with self.fast_linears():
                        figures = self.train_step()
                except NonFiniteError as err:
                    raise NonFiniteError(f"{err}; the step's samples: {self.describe_step_samples()}") from None
                self.scheduler.step()
                self.step += 1
                figures, self.mix_figures = {**figures, **self.mix_figures}, {}
                record = {"step": self.step, "train/lr": lr, **figures}
                self.history.steps.append(record)
                self.check_divergence()
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
        with self.fast_linears():
            result = self.evaluate()
        if result is None:
            return None
        self.history.evals.append({"step": self.step, **result})
        self.tracker.log(result, self.step)
        return result

    def save_checkpoint(self, lifetime: str) -> Path:
        """Save the current step as a 'permanent' or 'temporary' checkpoint (every rank calls this)."""
        path = self.checkpointer.save(self.step, self.checkpoint_state(), lifetime=lifetime, identity=self.identity)
        self.last_saved = self.step
        return path

    def check_stop_request(self) -> None:
        """At a step boundary: when any rank was signalled, every rank saves (unless this step is
        saved already) and the run stops.

        Raises:
            Stopped: with the user's line and exit code 128 + the signal number.
        """
        signum = agreed_signal(self.stop_request.signum, self.accelerator)
        if signum is None:
            return

        if self.last_saved != self.step and self.step > 0:
            self.save_checkpoint("temporary")
        saved = complete_checkpoints(self.checkpointer.root)
        where = f"checkpoint {saved[-1]}" if saved else "no checkpoint yet (nothing was trained)"
        advice = stop_advice(self.cfg.distributed.engine)
        raise Stopped(
            f"stopped by {signal_name(signum)} at step {self.step}; {where}; {advice}",
            128 + signum,
        )

    def check_divergence(self) -> None:
        """After a step: stop a run whose loss climbed far above its start or whose weights blew
        up (train.divergence), on every rank together; nothing is saved or published.

        Raises:
            Diverged: naming the reason and the checkpoint a rerun would resume.
        """
        cfg = self.cfg.train.divergence
        if not cfg.enabled:
            return
        losses = (
            [float(r["train/loss"]) for r in self.history.steps if "train/loss" in r] if self.loss_can_diverge else []
        )
        reason = loss_divergence(losses, cfg)
        if reason is None:
            params = (p for p in self.model.parameters() if p.requires_grad)
            reason = weight_divergence(largest_weight(params), cfg)
        if not ranks_max(int(reason is not None), self.accelerator):
            return
        saved = complete_checkpoints(self.checkpointer.root)
        where = f"the last checkpoint is {saved[-1]}" if saved else "there is no checkpoint"
        again = (
            "rerun with checkpoint.resume_changed: true"
            if resumes(self.cfg.distributed.engine)
            else "rerun with checkpoint.resume false"
        )
        raise Diverged(
            f"diverged at step {self.step}: {reason or 'on another rank'}; nothing was published, {where} "
            f"(lower train.learning_rate and {again}, or set train.divergence.enabled: false)"
        )

    def describe_step_samples(self, limit: int = 8) -> str:
        """The current step's samples on this rank, by their source (file:line) where they have one."""
        indices = [i for group in self.step_indices for i in group]
        names = []
        for i in indices[:limit]:
            sample = self.train_samples[i] if i < len(self.train_samples) else None
            source = sample.get("source") if isinstance(sample, dict) else None
            names.append(source or f"#{i}")
        more = f" and {len(indices) - limit} more" if len(indices) > limit else ""
        return ", ".join(names) + more if names else "(none recorded)"

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
        self.check_stop_request()
        if stop_at is not None and self.step == stop_at:
            if self.last_saved != self.step:
                self.save_checkpoint("temporary")
            log.warning("%s=%d: saved and stopping", STOP_ENV, stop_at)
            return "interrupted"
        if stop:
            log.info(
                "early stopping at step %d (no better eval loss in %d evaluations)",
                self.step,
                t.early_stopping_stall_num,
            )
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

    def optimizer_step(self, count: int, micro_batch) -> float:
        """The engine's one optimizer step (`engine.steps.optimizer_step`) on this stage's model and
        optimizer over `count` micro-batches, `micro_batch(index)` running one and returning its
        loss; returns the gradient norm before clipping.

        Raises:
            NonFiniteError: a non-finite loss or gradient (the optimizer has not stepped).
        """
        return optimizer_step(
            self.model,
            self.optimizer,
            self.accelerator,
            count,
            micro_batch,
            step=self.step + 1,
            max_grad_norm=self.cfg.train.max_grad_norm,
        ).grad_norm

    def next_sample_indices(self, grad_accum: Optional[int] = None) -> list[list[int]]:
        """This rank's sample indices of the next optimizer step's micro-batches (advances the
        cursor; the order is a pure function of the seed, the epoch and the global batch)."""
        t, acc = self.cfg.train, self.accelerator

        def draw(rank: int):
            return next_micro_batches(
                len(self.train_samples),
                self.cursor,
                seed=t.seed,
                batch_size=t.batch_size,
                grad_accum=t.grad_accum if grad_accum is None else grad_accum,
                world_size=acc.num_processes,
                rank=rank,
                order_of=self.mix.epoch_order if self.mix is not None else None,
            )

        if self.mix is not None:  # every rank's share: the figures count the global batch
            drawn = [i for r in range(acc.num_processes) for group in draw(r)[0] for i in group]
            for key, value in self.mix.step_figures(self.train_samples, drawn).items():
                self.mix_figures[key] = self.mix_figures.get(key, 0.0) + value
        groups, self.cursor = draw(acc.process_index)
        self.step_indices = groups
        return groups

    def collate(self, collator, samples: Sequence, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """One batch of `samples[indices]` on this rank's device."""
        return {k: v.to(self.accelerator.device) for k, v in collator([samples[i] for i in indices]).items()}
