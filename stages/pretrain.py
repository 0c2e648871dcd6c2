"""PT stage: continued pretraining on raw text (documents joined with EOS, packed, no cross-document attention).

    torchrun --nproc_per_node N stages/pretrain.py --config configs/pt.yaml [--train.max_steps 20]
    python stages/pretrain.py                              # one process, bundled sample data

Documents are tokenized, each followed by EOS, and cut into `train.seq_length` rows; a row's
attention stays inside each document (block-causal mask, or position_ids under flash-attention:
data_formats/collate.py). Every token is trained except the first of each document piece.
With `data.streaming: true` the training corpus is read lazily in file order (data_formats/streaming.py)
instead of being tokenized into memory and shuffled; resume restores the stream position.
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
    next_batches,
    next_stream_batches,
    parent_problems,
    run_eval,
    end_of_step,
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
    train: object
    """Packed rows (a list), or a PackedTextStream with data.streaming."""
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
    if cfg.data.streaming and cfg.data.max_samples is not None:
        problems.append("data.max_samples: not used with data.streaming (the stream runs until train.max_steps)")
    if cfg.data.streaming and not cfg.data.eval and cfg.data.eval_fraction > 0:
        problems.append("data.eval_fraction: carving an eval split reads the whole corpus into memory, which "
                        "data.streaming exists to avoid; give held-out files in data.eval")
    model_path = resolve_model_path(cfg.model.path)
    problems += parent_problems(model_path)
    if problems:
        raise ConfigError(problems)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code, cfg.model.revision)
    try:
        train = stream_train(cfg, tokenizer) if cfg.data.streaming else build_pt_data(cfg.data, tokenizer, cfg.train.seq_length, "train")
        has_eval = bool(cfg.data.eval) or cfg.data.eval_fraction > 0
        evaluation = build_pt_data(cfg.data, tokenizer, cfg.train.seq_length, "eval") if has_eval else []
    except (DataError, ValueError) as err:
        raise ConfigError([str(err)]) from err
    world = launched_world_size()
    if not cfg.data.streaming and len(train) < cfg.train.batch_size * world:
        raise ConfigError([f"data.train: {len(train)} packed row(s) of {cfg.train.seq_length} tokens cannot fill one "
                           f"micro-batch of {cfg.train.batch_size} x {world} rank(s)"])
    return Prepared(tokenizer, train, evaluation)


def stream_train(cfg: PTConfig, tokenizer):
    """The streamed training corpus, after one pass that reads (without keeping) every record so
    bad ones are reported together before training, as for an in-memory corpus.

    Raises:
        DataError: bad records with on_error='strict'.
    """
    from data_formats.streaming import PackedTextStream, stream_problems
    from data_formats.validate import apply_policy

    apply_policy(stream_problems(cfg.data.train, fmt=cfg.data.format, text_field=cfg.data.text_field), cfg.data.on_error,
                 "pt train data (streamed)")
    return PackedTextStream(cfg.data.train, tokenizer, cfg.train.seq_length, fmt=cfg.data.format, text_field=cfg.data.text_field,
                            on_error=cfg.data.on_error)


# ------------------------------------------------------------------------------------------
# Setup
# ------------------------------------------------------------------------------------------


def setup(cfg: PTConfig, prepared: Prepared) -> Run:
    """Accelerator, model (full/LoRA/QLoRA), optimizer, scheduler, trackers; resume if due."""
    from data_formats.collate import Collator

    collator = Collator(prepared.tokenizer.pad_token_id, "pack", cfg.train.seq_length, cfg.model.attn_implementation)
    streamed = cfg.data.streaming
    run = build_run(cfg, STAGE, tokenizer=prepared.tokenizer, collator=collator, train_samples=[] if streamed else prepared.train,
                    eval_samples=prepared.eval, tasks=TASKS, extra={"stream": prepared.train} if streamed else None)
    if run.is_main:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        save_config(cfg, Path(cfg.output_dir) / "config.yaml")
        rows = "streamed training rows" if streamed else f"{len(prepared.train)} training row(s)"
        log.info("pt: %s, %d eval row(s) of %d tokens", rows, len(prepared.eval), cfg.train.seq_length)
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
        batches = next_stream_batches(run, run.extra["stream"]) if "stream" in run.extra else next_batches(run)
        lr = run.scheduler.get_last_lr()[0]
        started = time.perf_counter()
        result = train_step(run.model, run.optimizer, batches, run.accelerator, step=run.step + 1,
                            max_grad_norm=t.max_grad_norm)
        run.scheduler.step()
        run.step += 1
        log_step(run, result, lr, time.perf_counter() - started, batches)
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}")
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
