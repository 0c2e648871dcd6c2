"""PT stage: continued pretraining on raw text (documents joined with EOS, packed, no cross-document attention).

    torchrun --nproc_per_node N stages/pretrain.py --config configs/pt.yaml [--train.max_steps 20]
    python stages/pretrain.py                              # one process, bundled sample data

Documents are tokenized, each followed by EOS, and cut into `train.seq_length` rows; a row's
attention stays inside each document (block-causal mask, or position_ids under flash-attention:
data_formats/collate.py). Every token is trained except the first of each document piece.
Loss normalisation, accumulation, checkpoints, resume, trackers and the final merge are the
shared ones in pipeline/training.py (the SFT stage uses the same pieces).

Outputs (ARCHITECTURE.md): <output_dir>/{config.yaml, checkpoints/, runs/, adapter/, merged/,
summary.json}; merged/ is the SFT stage's base. RELAY_STOP_AFTER_STEP=k saves and exits after step k.
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

from pipeline.config import ConfigError, StageConfig, TextDataConfig, load_config, save_config
from pipeline.training import (
    Run,
    build_run,
    data_problems,
    launched_world_size,
    finish,
    log_step,
    maybe_checkpoint,
    next_batches,
    parent_problems,
    run_eval,
    save_checkpoint,
    stop_after_step,
    train_step,
)

log = logging.getLogger("relay.pretrain")
STAGE = "pt"
TASKS = ["pt"]


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class PTData(TextDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/pt/train.jsonl"])
    """Raw text: JSONL/JSON/Parquet records with `text_field`, or .txt files."""
    eval: list[str] = field(default_factory=lambda: ["data/sample/pt/valid.jsonl"])
    """Held-out text for eval/loss and eval/ppl."""


@dataclass
class PTConfig(StageConfig):
    output_dir: str = "outputs/pt"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the SFT stage's base), summary.json."""
    data: PTData = field(default_factory=PTData)


@dataclass
class Prepared:
    """What validation built and setup reuses."""

    tokenizer: object
    train: list
    eval: list


# ------------------------------------------------------------------------------------------
# Validate
# ------------------------------------------------------------------------------------------


def validate(cfg: PTConfig) -> Prepared:
    """Check config, data files, records (in data.on_error mode) and the parent manifest; tokenize
    and pack the corpus. Nothing heavy loads before this passes.

    Raises:
        ConfigError: listing every problem found.
    """
    from data_formats.datasets import build_pt_data
    from data_formats.sources import DataError
    from pipeline.models import load_tokenizer, resolve_model_path

    problems = cfg.problems() + data_problems(cfg.data.train, "data.train") + data_problems(cfg.data.eval, "data.eval")
    if cfg.data.streaming:
        problems.append("data.streaming: not supported yet (the corpus is tokenized in memory); set it to false")
    model_path = resolve_model_path(cfg.model.path)
    problems += parent_problems(model_path)
    if problems:
        raise ConfigError(problems)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.model.revision)
    try:
        train = build_pt_data(cfg.data, tokenizer, cfg.train.seq_length, "train")
        has_eval = bool(cfg.data.eval) or cfg.data.eval_fraction > 0
        evaluation = build_pt_data(cfg.data, tokenizer, cfg.train.seq_length, "eval") if has_eval else []
    except (DataError, ValueError) as err:
        raise ConfigError([str(err)]) from err
    world = launched_world_size()
    if len(train) < cfg.train.batch_size * world:
        raise ConfigError([f"data.train: {len(train)} packed row(s) of {cfg.train.seq_length} tokens cannot fill one "
                           f"micro-batch of {cfg.train.batch_size} x {world} rank(s)"])
    return Prepared(tokenizer, train, evaluation)


# ------------------------------------------------------------------------------------------
# Setup
# ------------------------------------------------------------------------------------------


def setup(cfg: PTConfig, prepared: Prepared) -> Run:
    """Accelerator, model (full/LoRA/QLoRA), optimizer, scheduler, trackers; resume if due."""
    from data_formats.collate import Collator

    collator = Collator(prepared.tokenizer.pad_token_id, "pack", cfg.train.seq_length, cfg.model.attn_implementation)
    run = build_run(cfg, STAGE, tokenizer=prepared.tokenizer, collator=collator, train_samples=prepared.train,
                    eval_samples=prepared.eval, tasks=TASKS)
    if run.is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.output_dir) / "config.yaml")
        log.info("pt: %d training row(s), %d eval row(s) of %d tokens", len(prepared.train), len(prepared.eval), cfg.train.seq_length)
    return run


# ------------------------------------------------------------------------------------------
# Train
# ------------------------------------------------------------------------------------------


def train(run: Run) -> bool:
    """The training loop; returns False when stopped early by RELAY_STOP_AFTER_STEP.

    Raises:
        NonFiniteError: a NaN/inf loss or gradient (before the optimizer steps on it).
    """
    t = run.cfg.train
    stop_at = stop_after_step()
    bar = tqdm(total=t.max_steps, initial=run.step, desc=STAGE, disable=not run.is_main)
    while run.step < t.max_steps:
        batches = next_batches(run)
        lr = run.scheduler.get_last_lr()[0]
        started = time.perf_counter()
        result = train_step(run.model, run.optimizer, batches, run.accelerator, step=run.step + 1,
                            max_grad_norm=t.max_grad_norm)
        run.scheduler.step()
        run.step += 1
        log_step(run, result, lr, time.perf_counter() - started, batches)
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}")
        stop = False
        if t.eval_steps and run.step % t.eval_steps == 0:
            stop = bool((run_eval(run) or {}).get("stop"))
        maybe_checkpoint(run)
        if stop_at is not None and run.step == stop_at:
            if run.last_saved != run.step:
                save_checkpoint(run, "temporary")
            log.warning("RELAY_STOP_AFTER_STEP=%d: saved and stopping", stop_at)
            return False
        if stop:
            log.info("early stopping at step %d (no better eval loss in %d evaluations)", run.step, t.early_stopping_stall_num)
            break
    bar.close()
    if not run.history.evals or run.history.evals[-1]["step"] != run.step:
        run_eval(run)
    return True


# ------------------------------------------------------------------------------------------
# Entry points
# ------------------------------------------------------------------------------------------


def run_stage(cfg: PTConfig) -> Run:
    """validate -> setup -> train -> save (merged/ on completion). Returns the run."""
    prepared = validate(cfg)
    run = setup(cfg, prepared)
    if train(run):
        finish(run)
    return run


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(PTConfig, argv, prog="stages/pretrain.py")
        run_stage(cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
