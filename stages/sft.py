"""SFT stage: multi-turn, multitask supervised fine-tuning (loss on assistant turns only).

    torchrun --nproc_per_node N stages/sft.py --config configs/sft.yaml [--train.max_steps 20]
    python stages/sft.py                                   # one process, bundled sample data

Every training folder / `data_name` is a task. `multitask.weighted_loss_mode` picks the loss:
none (token mean), case3 (mean of per-task token means, MFTCoder) or coba / self-paced (CoBa
weights from the tasks' validation-loss trends, see pipeline/algorithms/multitask.py). Accumulation is
token-normalised over the whole accumulated batch and all ranks (pipeline/engine/steps.py), so the
loss and gradient do not depend on how the global batch is split.

Outputs (ARCHITECTURE.md): <output_dir>/{config.yaml, checkpoints/, runs/, adapter/, merged/,
summary.json}; merged/ is the next stage's base. Resume is automatic from the newest complete
checkpoint in <output_dir>/checkpoints (checkpoint.resume). RELAY_STOP_AFTER_STEP=k saves and exits
after step k (debugging / resume tests).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_formats.collate import Collator
from data_formats.datasets import build_sft_data
from data_formats.render import template_jinja
from pipeline.algorithms.multitask import MODES, CoBa, MultitaskConfig, step_weights
from pipeline.config import ChatDataConfig, StageConfig
from pipeline.engine.language_modeling import LanguageModelStage
from pipeline.engine.stage_main import main

log = logging.getLogger("relay.sft")


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class SFTData(ChatDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/sft/train"])
    """Training conversations: files, folders (one task per file or per `data_name`), globs."""
    eval: list[str] = field(default_factory=list)
    """Held-out conversations (tasks matched to the training tasks by name). None by default
    (data.eval_fraction carves them off `train`)."""


@dataclass
class SFTConfig(StageConfig):
    output_dir: str = "outputs/sft"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the RM stage's base), summary.json."""
    data: SFTData = field(default_factory=SFTData)
    multitask: MultitaskConfig = field(default_factory=MultitaskConfig)


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class SFTStage(LanguageModelStage):
    name = "sft"
    config_class = SFTConfig

    def __init__(self, cfg: SFTConfig):
        super().__init__(cfg)
        self.coba: Optional[CoBa] = None
        """CoBa's task weights (weighted_loss_mode coba), else None."""

    def problems(self) -> list[str]:
        mt = self.cfg.multitask
        entry = MODES.get(mt.weighted_loss_mode)  # an unknown mode: the section's own check
        if entry is not None and entry.adaptive and not self.cfg.data.has_eval:
            mode = mt.weighted_loss_mode
            return [f"multitask.weighted_loss_mode: {mode} needs held-out data (data.eval or data.eval_fraction)"]
        return []

    def build_data(self) -> list[str]:
        """Render and tokenize the conversations; tasks are the training tasks (eval ids index them)."""

        cfg, tok = self.cfg, self.tokenizer
        template = self.data_template()
        train = build_sft_data(cfg.data, tok, template, cfg.train.seq_length, "train")
        # Tool conversations in the default layout: the saved template must render them as trained.
        self.chat_template = template_jinja(template, tok, tools=train.stats.get("tool_conversations", 0) > 0)
        evaluation = (
            build_sft_data(cfg.data, tok, template, cfg.train.seq_length, "eval", tasks=train.tasks)
            if cfg.data.has_eval
            else None
        )
        self.train_samples, self.tasks = train.samples, train.tasks
        self.eval_samples = evaluation.samples if evaluation is not None else []
        self.collator = Collator(
            tok.pad_token_id, cfg.data.padding_mode, cfg.train.seq_length, cfg.model.attn_implementation
        )
        mt = cfg.multitask
        if MODES[mt.weighted_loss_mode].adaptive:
            self.coba = CoBa(
                len(self.tasks),
                warmup_steps=mt.coba_warmup_steps,
                history_length=mt.coba_history_length,
                tau=mt.coba_tau,
                min_weight=mt.coba_min_weight,
                clamp_divergence=mt.coba_clamp_divergence,
            )
        log.info(
            "sft: %d training sample(s) in %d task(s) %s, %d eval sample(s)",
            len(self.train_samples),
            len(self.tasks),
            self.tasks,
            len(self.eval_samples),
        )
        return self.data_problems_found(evaluation.tasks if evaluation is not None else [])

    def data_problems_found(self, eval_tasks: list[str]) -> list[str]:
        """Task weights naming no task, a split that cannot fill a batch, eval tasks unknown to training."""
        cfg, out = self.cfg, []
        unknown = sorted(set(cfg.multitask.task_weights) - set(self.tasks))
        if unknown:
            out.append(f"multitask.task_weights: unknown task(s) {unknown}; tasks are {self.tasks}")
        out += self.fill_problems(len(self.train_samples), "sample(s)")
        extra = sorted(set(eval_tasks) - set(self.tasks))
        if extra:
            out.append(f"data.eval: task(s) {extra} do not appear in the training data")
        mode = cfg.multitask.weighted_loss_mode
        held = {s["task_id"] for s in self.eval_samples}
        unmeasured = [name for k, name in enumerate(self.tasks) if k not in held]
        if MODES[mode].adaptive and cfg.data.has_eval and unmeasured:
            out.append(
                f"multitask.weighted_loss_mode: {mode} weighs each task by its held-out loss, and task(s) "
                f"{unmeasured} have no held-out sample (give them data.eval files, or a larger data.eval_fraction)"
            )
        return out

    def task_weights(self) -> Optional[list[float]]:
        """The weights of multitask.weighted_loss_mode's entry: CoBa's where they adapt, else
        multitask.task_weights by task name (None for the token mean)."""
        mt = self.cfg.multitask
        weights = self.coba.weights() if self.coba is not None else [mt.task_weights.get(n, 1.0) for n in self.tasks]
        return step_weights(mt.weighted_loss_mode, weights, len(self.tasks))

    def train_step(self) -> dict[str, float]:
        figures = super().train_step()
        step = self.step + 1
        if self.coba is not None and step % self.cfg.multitask.coba_update_interval == 0:
            self.update_coba(step)
        return figures

    def update_coba(self, step: int) -> None:
        """Measure per-task validation losses on a few eval batches (rotating through the split)
        and feed them to CoBa. The first measurement is CoBa's reference, so it uses the whole split."""
        mt = self.cfg.multitask
        limit = None if self.coba.first is None else mt.coba_valid_batches
        offset = (step // mt.coba_update_interval) * mt.coba_valid_batches
        self.coba.update(self.heldout_losses(limit, offset)["task_losses"])

    def state_dict(self) -> dict:
        return {"coba": self.coba.state_dict()} if self.coba is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.coba is not None:
            self.coba.load_state_dict(state["coba"])


if __name__ == "__main__":
    raise SystemExit(main(SFTStage))
