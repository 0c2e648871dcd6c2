"""RM stage: a pairwise reward model on the previous stage's merged model.

    torchrun --nproc_per_node N stages/reward.py --config configs/rm.yaml [--train.max_steps 20]
    python stages/reward.py                                 # one process, bundled sample data

A sequence classifier with one output (`score` head) on the SFT model; chosen and rejected
answers are rendered with the SFT chat template, each side ending at the end-of-turn token that
closes its answer, and scored there (`pipeline.modeling.scoring.reward_readout_index`, the token PPO reads).
`data.truncation: truncate` cuts the oldest prompt tokens, never the answer. Loss:
-logsigmoid(r_chosen - r_rejected - margin) (+ `reward.center_rewards_coefficient` *
mean((r_chosen + r_rejected)^2), InstructGPT/TRL's centring). With LoRA the head is trained in
full (modules_to_save) and survives the merge.

merged/ is a plain `AutoModelForSequenceClassification` folder; its manifest.json (`reward_stats`)
and config.json (`relay_reward_stats`) record the mean/std of its scores over the training
responses, so PPO can normalise rewards without recomputing them.

The flow, checkpoint/resume, trackers and RELAY_STOP_AFTER_STEP=k are the engine's
(pipeline/engine/stage.py), as in every stage.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm.auto import tqdm

from data_formats.collate import PairCollator
from data_formats.datasets import build_preference_data
from data_formats.render import template_jinja
from pipeline.algorithms.pairwise import pair_scores, pairwise_loss, record_stats_in_config, stats_of
from pipeline.config import PreferenceDataConfig, StageConfig
from pipeline.engine.held_out import eval_shards, ratio
from pipeline.engine.stage import Stage
from pipeline.engine.stage_main import main
from pipeline.engine.steps import rank_mean
from pipeline.modeling.models import eval_mode

log = logging.getLogger("relay.rm")


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class RMData(PreferenceDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/rm/train.jsonl"])
    """Preference pairs: {question, response_chosen, response_rejected}, {prompt, chosen, rejected} or chat lists."""
    eval: list[str] = field(default_factory=list)
    """Held-out pairs for eval/accuracy, eval/margin and eval/loss. None by default
    (data.eval_fraction carves them off `train`)."""


@dataclass
class RewardSection:
    center_rewards_coefficient: Optional[float] = None
    """Weight of mean((r_chosen + r_rejected)^2), keeping scores centred on 0 (TRL uses 0.01). None: off."""
    stats_max_pairs: Optional[int] = None
    """Compute the stored reward statistics on at most this many training pairs (None: all)."""


@dataclass
class RMConfig(StageConfig):
    output_dir: str = "outputs/rm"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (PPO's reward model), summary.json."""
    data: RMData = field(default_factory=RMData)
    reward: RewardSection = field(default_factory=RewardSection)


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class RMStage(Stage):
    name = "rm"
    config_class = RMConfig
    model_kind = "reward"

    def __init__(self, cfg: RMConfig):
        super().__init__(cfg)
        self.reward_stats: Optional[dict] = None
        """Mean/std of the trained model's scores over the training responses (set before export)."""

    def problems(self) -> list[str]:
        out = []
        if self.cfg.data.padding_mode != "padding":
            out.append("data.padding_mode: the RM stage pads pairs ('padding'); packing is not supported")
        coef = self.cfg.reward.center_rewards_coefficient
        if coef is not None and coef < 0:
            out.append("reward.center_rewards_coefficient: must be >= 0")
        return out

    def build_data(self) -> list[str]:
        """The tokenised pairs, each side ending at its answer's end-of-turn token."""
        cfg, tok = self.cfg, self.tokenizer
        template = self.data_template()
        stats: dict = {}
        self.train_samples = build_preference_data(cfg.data, tok, template, cfg.train.seq_length, "train", stats=stats)
        # Tool conversations in the default layout: the saved template must render them as trained.
        self.chat_template = template_jinja(template, tok, tools=stats.get("tool_conversations", 0) > 0)
        if cfg.data.has_eval:
            self.eval_samples = build_preference_data(cfg.data, tok, template, cfg.train.seq_length, "eval")
        self.collator = PairCollator(tok.pad_token_id)
        log.info("rm: %d training pair(s), %d eval pair(s)", len(self.train_samples), len(self.eval_samples))
        return self.fill_problems(len(self.train_samples), "pair(s)")

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this rank's equal-sized micro-batches (so the mean of per-batch
        means is the pair mean); loss, accuracy and grad_norm averaged over ranks.

        Raises:
            NonFiniteError: loss or gradients not finite (the optimizer has not stepped).
        """
        acc, coef = self.accelerator, self.cfg.reward.center_rewards_coefficient
        groups = self.next_sample_indices()
        totals = {"loss": 0.0, "accuracy": 0.0}

        def micro_batch(index: int) -> torch.Tensor:
            batch = self.collate(self.collator, self.train_samples, groups[index])
            chosen, rejected = pair_scores(self.model, batch, acc)
            loss = pairwise_loss(chosen, rejected, batch["margin"], coef)
            acc.backward(loss)
            totals["loss"] += float(loss.detach()) / len(groups)
            totals["accuracy"] += float((chosen > rejected).float().mean()) / len(groups)
            return loss

        grad_norm = self.optimizer_step(len(groups), micro_batch)
        figures = rank_mean(totals, acc)
        return {"train/loss": figures["loss"], "train/accuracy": figures["accuracy"], "train/grad_norm": grad_norm}

    @torch.no_grad()
    def score_pairs(
        self, pairs: list, max_batches: Optional[int] = None, desc: Optional[str] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) scores of `pairs`, gathered from every rank (padding batches excluded;
        the reward statistics need the scores themselves, so this is not the held-out loop); with
        `desc`, a progress bar of that name (long passes)."""
        acc = self.accelerator
        chosen, rejected = [], []
        shards = list(
            eval_shards(len(pairs), self.cfg.train.batch_size, acc.num_processes, acc.process_index, max_batches)
        )
        with eval_mode(self.model):
            for indices, counts in tqdm(
                shards, desc=desc, disable=desc is None or not acc.is_local_main_process, leave=False
            ):
                c, r = pair_scores(self.model, self.collate(self.collator, pairs, indices), acc)
                keep = torch.full_like(c, 1.0 if counts else float("nan"))
                chosen.append(c * keep)
                rejected.append(r * keep)
        c, r = torch.cat(chosen), torch.cat(rejected)
        if acc.num_processes > 1:  # ranks may hold different numbers of pairs: NaN-padded to one length
            c, r = (acc.gather(acc.pad_across_processes(x, pad_index=float("nan"))) for x in (c, r))
        ok = ~torch.isnan(c)
        return c[ok].cpu(), r[ok].cpu()

    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/accuracy, eval/margin (mean r_c - r_r) and eval/loss on the held-out pairs."""
        if not self.eval_samples:
            return None

        def figures(indices: list[int]) -> dict:
            chosen, rejected = pair_scores(self.model, self.collate(self.collator, self.eval_samples, indices), acc)
            chosen, rejected = chosen.double(), rejected.double()
            return {
                "pairs": len(indices),
                "accuracy": (chosen > rejected).sum(),
                "margin": (chosen - rejected).sum(),
                # the plain pairwise loss (no margin column, no centring), comparable across runs
                "loss": pairwise_loss(chosen, rejected) * len(indices),
            }

        acc = self.accelerator
        with eval_mode(self.model):
            sums = self.held_out(figures)
        return {f"eval/{key}": ratio(sums, key, "pairs") for key in ("accuracy", "margin", "loss")}

    def before_export(self) -> None:
        """The reward statistics over the training responses (both sides), for PPO's normaliser."""
        limit = self.cfg.reward.stats_max_pairs
        chosen, rejected = self.score_pairs(
            self.train_samples[:limit] if limit else self.train_samples, desc="reward statistics"
        )
        self.reward_stats = stats_of(torch.cat([chosen, rejected]))
        log.info("reward statistics over the training responses: %s", self.reward_stats)

    def manifest_extras(self) -> dict:
        return {"reward_stats": self.reward_stats}

    def export(self, summary: dict) -> Optional[Path]:
        merged = super().export(summary)
        if merged is not None:
            record_stats_in_config(Path(merged), self.reward_stats)
        return merged

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{figures['train/loss']:.4f}", "acc": f"{figures['train/accuracy']:.2f}"}

    def summary(self) -> dict:
        return {
            **self.history.pick(
                train_loss_first="train/loss:first",
                train_loss_last="train/loss",
                train_accuracy_last="train/accuracy",
                eval_accuracy="eval/accuracy",
                eval_margin="eval/margin",
                eval_loss_last="eval/loss",
                eval_loss_first="eval/loss:first",
            ),
            "reward_stats": self.reward_stats,
            **self.run_figures(),
        }


if __name__ == "__main__":
    raise SystemExit(main(RMStage))
