"""SFT stage: multi-turn, multitask supervised fine-tuning (loss on assistant turns only).

    torchrun --nproc_per_node N stages/sft.py --config configs/sft.yaml [--train.max_steps 20]
    python stages/sft.py                                   # one process, bundled sample data

Every training folder / `data_name` is a task. `multitask.weighted_loss_mode` picks the loss:
none (token mean), case3 (mean of per-task token means, MFTCoder) or coba / self-paced (CoBa
weights from the tasks' validation-loss trends, see pipeline/multitask.py). Accumulation is
token-normalised over the whole accumulated batch and all ranks (pipeline/training.py), so the
loss and gradient do not depend on how the global batch is split.

Outputs (ARCHITECTURE.md): <output_dir>/{config.yaml, checkpoints/, runs/, adapter/, merged/,
summary.json}; merged/ is the next stage's base. Resume is automatic from the newest complete
checkpoint in <output_dir>/checkpoints (checkpoint.resume). RELAY_STOP_AFTER_STEP=k saves and exits
after step k (debugging / resume tests).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm.auto import tqdm

from pipeline.config import ChatDataConfig, ConfigError, StageConfig, load_config, save_config
from pipeline.multitask import CoBa, MultitaskConfig, canonical_mode
from pipeline.training import (
    Run,
    build_run,
    data_problems,
    launched_world_size,
    eval_batches,
    evaluate,
    finish,
    log_step,
    next_batches,
    parent_problems,
    run_eval,
    end_of_step,
    stop_after_step,
    train_step,
)

log = logging.getLogger("relay.sft")
STAGE = "sft"


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class SFTData(ChatDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/sft/train"])
    """Training conversations: files, folders (one task per file or per `data_name`), globs."""
    eval: list[str] = field(default_factory=lambda: ["data/sample/sft/valid"])
    """Held-out conversations (tasks matched to the training tasks by name)."""


@dataclass
class SFTConfig(StageConfig):
    output_dir: str = "outputs/sft"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the RM stage's base), summary.json."""
    data: SFTData = field(default_factory=SFTData)
    multitask: MultitaskConfig = field(default_factory=MultitaskConfig)


@dataclass
class Prepared:
    """What validation built and setup reuses (so data is read and checked once)."""

    tokenizer: object
    template: object
    train: object
    eval: object


# ------------------------------------------------------------------------------------------
# Validate: every problem at once, before any model loads
# ------------------------------------------------------------------------------------------


def _sft_config_problems(cfg: SFTConfig) -> list[str]:
    out = []
    mt = cfg.multitask
    if cfg.data.group_by_length:
        out.append("data.group_by_length: not supported by the SFT stage (batch order must stay a pure function of seed and epoch)")
    if cfg.data.task_sampling_weights:
        out.append("data.task_sampling_weights: not supported by the SFT stage; use multitask.task_weights (loss weights)")
    if mt.weighted_loss_mode in ("coba", "self-paced") and not cfg.data.eval and cfg.data.eval_fraction <= 0:
        out.append("multitask.weighted_loss_mode: coba needs held-out data (data.eval or data.eval_fraction)")
    return out


def _data_and_task_problems(cfg: SFTConfig, prepared: Prepared) -> list[str]:
    out = []
    tasks = prepared.train.tasks
    unknown = sorted(set(cfg.multitask.task_weights) - set(tasks))
    if unknown:
        out.append(f"multitask.task_weights: unknown task(s) {unknown}; tasks are {tasks}")
    world = launched_world_size()
    if len(prepared.train) < cfg.train.batch_size * world:
        out.append(f"data.train: {len(prepared.train)} sample(s) cannot fill one micro-batch of {cfg.train.batch_size} x {world} rank(s)")
    extra = sorted(set(prepared.eval.tasks) - set(tasks)) if prepared.eval is not None else []
    if extra:
        out.append(f"data.eval: task(s) {extra} do not appear in the training data")
    return out


def validate(cfg: SFTConfig) -> Prepared:
    """Check config, data files, data records (in data.on_error mode) and the parent model's
    manifest; build the tokenized data. Nothing heavy loads before this passes.

    Raises:
        ConfigError: listing every problem found.
    """
    from data_formats.datasets import build_sft_data
    from data_formats.render import make_template
    from data_formats.sources import DataError
    from pipeline.models import load_tokenizer, resolve_model_path

    problems = cfg.problems() + _sft_config_problems(cfg)
    problems += data_problems(cfg.data.train, "data.train") + data_problems(cfg.data.eval, "data.eval")
    model_path = resolve_model_path(cfg.model.path)
    problems += parent_problems(model_path)
    if problems:
        raise ConfigError(problems)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.model.revision)
    try:
        template = make_template(cfg.data, tokenizer)
        train = build_sft_data(cfg.data, tokenizer, template, cfg.train.seq_length, "train")
        has_eval = bool(cfg.data.eval) or cfg.data.eval_fraction > 0
        evaluation = build_sft_data(cfg.data, tokenizer, template, cfg.train.seq_length, "eval", tasks=train.tasks) if has_eval else None
    except (DataError, ValueError) as err:
        raise ConfigError([str(err)]) from err
    prepared = Prepared(tokenizer, template, train, evaluation)
    problems = _data_and_task_problems(cfg, prepared)
    if problems:
        raise ConfigError(problems)
    return prepared


# ------------------------------------------------------------------------------------------
# Setup
# ------------------------------------------------------------------------------------------


def setup(cfg: SFTConfig, prepared: Prepared) -> Run:
    """Accelerator, model (full/LoRA/QLoRA), optimizer, scheduler, trackers, CoBa; resume if due."""
    from data_formats.collate import Collator
    from data_formats.render import template_jinja

    tasks = prepared.train.tasks
    # Eval task ids were assigned with tasks=train.tasks first, so they index the same list.
    eval_samples = prepared.eval.samples if prepared.eval is not None else []
    collator = Collator(prepared.tokenizer.pad_token_id, cfg.data.padding_mode, cfg.train.seq_length,
                        cfg.model.attn_implementation)
    extra = {}
    mt = cfg.multitask
    if canonical_mode(mt.weighted_loss_mode) == "coba":
        extra["coba"] = CoBa(len(tasks), warmup_steps=mt.coba_warmup_steps, history_length=mt.coba_history_length,
                             tau=mt.coba_tau, min_weight=mt.coba_min_weight, clamp_divergence=mt.coba_clamp_divergence)
    run = build_run(cfg, STAGE, tokenizer=prepared.tokenizer, collator=collator, train_samples=prepared.train.samples,
                    eval_samples=eval_samples, tasks=tasks, chat_template=template_jinja(prepared.template, prepared.tokenizer),
                    extra=extra)
    if run.is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.output_dir) / "config.yaml")
        log.info("sft: %d training sample(s) in %d task(s) %s, %d eval sample(s)", len(prepared.train), len(tasks), tasks, len(eval_samples))
    return run


def task_weights(run: Run, mt: MultitaskConfig) -> Optional[list[float]]:
    """The per-task loss weights of the next step (None: every task weighs 1)."""
    mode = canonical_mode(mt.weighted_loss_mode)
    if mode == "coba":
        return run.extra["coba"].weights()
    if mode == "case3":
        return [float(mt.task_weights.get(name, 1.0)) for name in run.tasks]
    return None


def update_coba(run: Run, mt: MultitaskConfig) -> None:
    """Measure per-task validation losses on a few eval batches (rotating through the split) and
    feed them to CoBa."""
    measurement = run.step // mt.coba_update_interval
    coba = run.extra["coba"]
    # The first measurement is CoBa's reference for every task, so it uses the whole split.
    limit = None if coba.first is None else mt.coba_valid_batches
    batches = eval_batches(run, limit, offset=measurement * mt.coba_valid_batches)
    result = evaluate(run.model, batches, run.accelerator, len(run.tasks))
    coba.update(result["task_losses"])


# ------------------------------------------------------------------------------------------
# Train
# ------------------------------------------------------------------------------------------


def train(run: Run) -> bool:
    """The training loop; returns False when stopped early by RELAY_STOP_AFTER_STEP.

    Raises:
        NonFiniteError: a NaN/inf loss or gradient (before the optimizer steps on it).
    """
    t = run.cfg.train
    mt = run.cfg.multitask
    stop_at = stop_after_step()
    bar = tqdm(total=t.max_steps, initial=run.step, desc=STAGE, disable=not run.is_main)
    while run.step < t.max_steps:
        batches = next_batches(run)
        weights = task_weights(run, mt)
        lr = run.scheduler.get_last_lr()[0]
        started = time.perf_counter()
        result = train_step(run.model, run.optimizer, batches, run.accelerator, step=run.step + 1,
                            num_tasks=len(run.tasks), mode=mt.weighted_loss_mode, task_weights=weights,
                            max_grad_norm=t.max_grad_norm)
        run.scheduler.step()
        run.step += 1
        log_step(run, result, lr, time.perf_counter() - started, batches, weights)
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}")
        if "coba" in run.extra and run.step % mt.coba_update_interval == 0:
            update_coba(run, mt)
        outcome = end_of_step(run, stop_at, lambda: bool((run_eval(run) or {}).get("stop")))
        if outcome == "interrupted":
            return False
        if outcome == "early_stop":
            break
    bar.close()
    if not run.history.evals or run.history.evals[-1]["step"] != run.step:
        run_eval(run)
    return True


# ------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------


def run_stage(cfg: SFTConfig) -> Run:
    """validate -> setup -> train -> save (merged/ on completion). Returns the run."""
    prepared = validate(cfg)
    run = setup(cfg, prepared)
    if train(run):
        finish(run)
    return run


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(SFTConfig, argv, prog="stages/sft.py")
        run_stage(cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
