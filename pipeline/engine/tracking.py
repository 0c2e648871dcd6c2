"""Experiment trackers: TensorBoard (default, `<output_dir>/runs/`) and W&B, several at once.

Only rank 0 should build an enabled Tracker; other ranks pass `enabled=False` and every call
becomes a no-op, so stage code never branches on the rank to log.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline.config import TrackingConfig


class TrackerError(RuntimeError):
    """A tracker named in the config cannot be used (e.g. wandb is not installed)."""


def default_run_name(stage: str) -> str:
    return f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}"


def event_files(output_dir: str | Path) -> list[Path]:
    """The TensorBoard event files under `<output_dir>/runs/`, sorted."""
    runs = Path(output_dir) / "runs"
    return sorted(runs.rglob("events.out.tfevents.*")) if runs.is_dir() else []


def set_aside_events(output_dir: str | Path, files: list[Path], suffix: Optional[str] = None) -> Optional[Path]:
    """Move the event files of a run that this one does not continue (it trains from step 0) from
    `<output_dir>/runs/` to `<output_dir>/runs.old-<suffix>/`, keeping their folders, and drop the
    folders this leaves empty; nothing is deleted. So `relay report` and TensorBoard show only the
    run that summary.json and merged/ come from. `suffix` is the one the previous run's moved-aside
    checkpoints got (`checkpoints.old-<suffix>`), else the time now. Returns the folder, or None
    when none of `files` is left to move."""
    runs = Path(output_dir) / "runs"
    files = [f for f in files if f.is_file()]
    if not files:
        return None
    aside = runs.with_name(f"runs.old-{suffix or time.strftime('%Y%m%d-%H%M%S')}")
    for path in files:
        target = aside / path.relative_to(runs)
        while target.exists():
            target = target.with_name(target.name + ".again")
        target.parent.mkdir(parents=True, exist_ok=True)
        path.rename(target)
        for folder in path.parents:
            if folder == runs or runs not in folder.parents:
                break
            try:
                folder.rmdir()
            except OSError:
                break
    return aside


class Tracker:
    """Logs scalars and text to every tracker in `cfg.trackers`."""

    def __init__(
        self, cfg: TrackingConfig, output_dir: str | Path, run_name: Optional[str], config: dict, enabled: bool = True
    ):
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
                    raise TrackerError(
                        "tracking.trackers has 'wandb' but wandb is not installed: pip install wandb"
                    ) from err
                run = wandb.init(project=cfg.project, entity=cfg.entity, name=name, config=config, dir=str(output_dir))
                self.writers.append((kind, run))
            else:
                raise TrackerError(f"tracking.trackers: unknown tracker {kind!r} (tensorboard, wandb)")

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log scalars at `step`; None and non-numbers are skipped, NaN/inf are logged as they are."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if any(k.startswith("eval/") for k in clean):  # every evaluation reaches the console too
            console(format_eval(clean, step))
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
        return self.stopped

    @property
    def stopped(self) -> bool:
        """Whether the evaluations so far ended training (a resumed run reads it from its checkpoint)."""
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

    def pick(self, **names: str) -> dict:
        """Summary figures by name, each read from a tag: 'tag' is its last recorded value,
        'tag:first' its first (an 'eval/' tag from the evaluations, others from the steps); None
        where never recorded."""
        out = {}
        for name, spec in names.items():
            tag, _, which = spec.partition(":")
            values = self.values(tag, evals=tag.startswith("eval/"))
            out[name] = (values[0] if which == "first" else values[-1]) if values else None
        return out

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


# ------------------------------------------------------------------------------------------
# The console: what a user reads while a stage runs
# ------------------------------------------------------------------------------------------


def console(line: str) -> None:
    """Print a line above any progress bar (tqdm.write keeps the bar intact)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)


def format_eval(figures: dict[str, float], step: int) -> str:
    """One line of an evaluation's figures: `eval @ step 20: loss 1.2345, ppl 3.44, accuracy 0.7500`."""
    parts = [
        f"{k.removeprefix('eval/')} {v:.4g}" if abs(v) >= 1e4 else f"{k.removeprefix('eval/')} {v:.4f}"
        for k, v in figures.items()
        if k.startswith("eval/") and "/" not in k.removeprefix("eval/")
    ]
    return f"eval @ step {step}: " + ", ".join(parts)


class _ReplaceOnce(logging.Filter):
    """Replace log records matching `match(text)` by `explanation` the first time, drop them after
    (always, when `explanation` is None: Relay says it itself)."""

    def __init__(self, match, explanation: Optional[str]):
        super().__init__()
        self.match, self.explanation, self.said = match, explanation, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.match(record.getMessage()):
            return True
        if self.said or self.explanation is None:
            return False
        self.said = True
        record.msg, record.args, record.levelno, record.levelname = self.explanation, (), logging.INFO, "INFO"
        return True


def _only_new_reward_head(text: str) -> bool:
    """A transformers load report whose only finding is a missing (new) `score.*` head."""
    if "LOAD REPORT" not in text:
        return False
    rows = [line.split("|") for line in text.splitlines() if line.count("|") >= 2 and not line.startswith(("Key", "-"))]
    return bool(rows) and all(r[0].strip().startswith("score.") and r[1].strip() == "MISSING" for r in rows)


QUIETED = (
    # (logger, match, the one line said instead)
    # pipeline.modeling.models logs its own line for a new reward head
    ("transformers.modeling_utils", _only_new_reward_head, None),
    (
        "bitsandbytes.backends.cpu.ops",
        lambda text: "pip install kernels" in text,
        "bitsandbytes: the optional CPU kernel package is unavailable; its built-in 4-bit path is used (harmless)",
    ),
)


def quiet_console() -> None:
    """Silence what a user cannot act on: weight-loading / shard-writing progress bars, the
    `is_gradient_checkpointing` deprecation (transformers calls it itself), and known-harmless
    library messages (QUIETED: said once in one line, or not at all where Relay explains it
    itself). RELAY_VERBOSE=1 keeps all."""
    if os.environ.get("RELAY_VERBOSE", "").strip() not in ("", "0"):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    else:
        # transformers reads this switch when it is imported: no 1-2 s import for a command that may never load a model
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* is deprecated", category=FutureWarning)
    for name, match, explanation in QUIETED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ReplaceOnce) for f in logger.filters):
            logger.addFilter(_ReplaceOnce(match, explanation))


def next_commands(stage: str, output_dir: str, model_kind: str) -> list[str]:
    """What a user runs after a stage: chat with the model, or hand it to the next stage."""
    merged = f"{output_dir}/merged"
    if model_kind == "reward":
        return [
            f"relay train configs/ppo.yaml --model.path POLICY --reward_model.path {merged}   # PPO against this RM"
        ]
    return [
        f"relay chat --model {merged}",
        f"relay train NEXT_STAGE.yaml --model.path {merged}   # continue from it",
        f"relay export {output_dir} --out {output_dir}-release   # a shippable folder with a model card",
    ]


def format_stage_summary(stage: str, summary: dict, output_dir: str, model_kind: str = "causal") -> str:
    """The few lines a stage ends with: its figures, its time, where merged/ is, what to run next."""
    figures = [
        f"{k} {v:.4f}"
        for k, v in summary.items()
        if isinstance(v, float) and k not in ("wall_seconds", "tokens_per_s") and math.isfinite(v)
    ]
    wall = summary.get("wall_seconds")
    lines = [
        f"{stage} done"
        + (f" in {wall:.0f} s" if isinstance(wall, (int, float)) else "")
        + (f" ({summary['steps']} steps)" if "steps" in summary else ""),
        "  " + ", ".join(figures) if figures else "",
        f"  model: {output_dir}/merged   (figures: {output_dir}/summary.json)",
        "next:",
    ] + [f"  {c}" for c in next_commands(stage, output_dir, model_kind)]
    return "\n".join(line for line in lines if line)
