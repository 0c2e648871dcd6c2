"""Experiment trackers: TensorBoard (default, `<output_dir>/runs/`) and W&B, several at once.

Only rank 0 should build an enabled Tracker; other ranks pass `enabled=False` and every call
becomes a no-op, so stage code never branches on the rank to log.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline.config import TrackingConfig


class TrackerError(RuntimeError):
    """A tracker named in the config cannot be used (e.g. wandb is not installed)."""


def default_run_name(stage: str) -> str:
    return f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}"


class Tracker:
    """Logs scalars and text to every tracker in `cfg.trackers`."""

    def __init__(self, cfg: TrackingConfig, output_dir: str | Path, run_name: Optional[str], config: dict, enabled: bool = True):
        """Open every tracker.

        Raises:
            TrackerError: 'wandb' requested but not installed, or an unknown tracker name.
        """
        self.enabled = enabled
        self.writers: list[tuple[str, Any]] = []
        if not enabled:
            return
        name = cfg.run_name or run_name or default_run_name("relay")
        for kind in cfg.trackers:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self.writers.append((kind, SummaryWriter(log_dir=str(Path(output_dir) / "runs" / name))))
            elif kind == "wandb":
                try:
                    import wandb
                except ImportError as err:
                    raise TrackerError("tracking.trackers has 'wandb' but wandb is not installed: pip install wandb") from err
                run = wandb.init(project=cfg.project, entity=cfg.entity, name=name, config=config, dir=str(output_dir))
                self.writers.append((kind, run))
            else:
                raise TrackerError(f"tracking.trackers: unknown tracker {kind!r} (tensorboard, wandb)")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log scalars at `step`; None and non-numbers are skipped, NaN/inf are logged as they are."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for kind, writer in self.writers:
            if kind == "tensorboard":
                for key, value in clean.items():
                    writer.add_scalar(key, value, step)
            else:
                writer.log(clean, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        if not self.enabled:
            return
        for kind, writer in self.writers:
            if kind == "tensorboard":
                writer.add_text(tag, text, step)
            else:
                writer.log({tag: text}, step=step)

    def close(self) -> None:
        for kind, writer in self.writers:
            if kind == "tensorboard":
                writer.flush()
                writer.close()
            else:
                writer.finish()
        self.writers = []


def perplexity(loss: float) -> float:
    """exp(loss), inf instead of an overflow error for huge losses."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")


@dataclass
class EarlyStopping:
    """MFTCoder's early stopping: stop after `patience` evaluations without a new best loss."""

    patience: int = 0
    best: float = float("inf")
    stalls: int = 0

    def update(self, loss: float) -> bool:
        """Record an eval loss; True when training should stop."""
        if loss < self.best:
            self.best, self.stalls = loss, 0
        else:
            self.stalls += 1
        return self.patience > 0 and self.stalls >= self.patience

    def state_dict(self) -> dict:
        return {"best": self.best if math.isfinite(self.best) else None, "stalls": self.stalls}

    def load_state_dict(self, state: dict) -> None:
        self.best = float("inf") if state.get("best") is None else float(state["best"])
        self.stalls = int(state["stalls"])


@dataclass
class History:
    """Every step's and every evaluation's figures (dicts keyed by tracker tag, plus "step"): the
    source of summary.json. It rides in every checkpoint, so a resumed run's summary covers the
    whole run, its wall time included."""

    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    tokens: int = 0
    """Real (non-padding) tokens trained on."""
    wall_before: float = 0.0
    """Seconds spent in this run before the process that resumed it started."""
    started: float = field(default_factory=time.time)

    def wall_seconds(self) -> float:
        return self.wall_before + time.time() - self.started

    def values(self, tag: str, evals: bool = False) -> list[float]:
        """Every recorded value of `tag`, in step order."""
        return [r[tag] for r in (self.evals if evals else self.steps) if tag in r]

    def summary(self) -> dict:
        """The headline figures of a loss-trained stage (first and last losses, speed)."""
        losses, evals = self.values("train/loss"), self.values("eval/loss", evals=True)
        wall = self.wall_seconds()
        return {
            "train_loss_first": losses[0] if losses else None,
            "train_loss_last": losses[-1] if losses else None,
            "eval_loss_first": evals[0] if evals else None,
            "eval_loss_last": evals[-1] if evals else None,
            "steps": self.steps[-1]["step"] if self.steps else 0,
            "wall_seconds": wall,
            "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
        }

    def state_dict(self) -> dict:
        return {"steps": self.steps, "evals": self.evals, "tokens": self.tokens, "wall_seconds": self.wall_seconds()}

    def load_state_dict(self, state: dict) -> None:
        """Raises: KeyError: a field is missing."""
        self.steps, self.evals, self.tokens = list(state["steps"]), list(state["evals"]), int(state["tokens"])
        self.wall_before, self.started = float(state["wall_seconds"]), time.time()
