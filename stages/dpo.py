"""DPO stage: tune the SFT policy directly on preference pairs (DPO and its variants, ORPO, SimPO), no reward model.

    torchrun --nproc_per_node N stages/dpo.py --config configs/dpo.yaml [--train.max_steps 20]
    python stages/dpo.py                                   # one process, bundled sample pairs

Reads the preference data the RM stage reads, in every format it accepts ({question,
response_chosen, response_rejected}, {prompt, chosen, rejected}, chat lists), rendered the same
way: each side is the prompt followed by its answer up to and including the answer's end-of-turn
token (data_formats.render.render_scored); truncation cuts the oldest prompt tokens, never an
answer. A side's log-prob is the sum over its answer tokens (TRL's). The math (`dpo.loss_type`:
sigmoid with label smoothing, ipo, orpo, simpo and TRL 1.16's other loss types) is the registry
in pipeline/algorithms/preference.py, checked against TRL 1.16 in tests/test_dpo.py and
tests/test_preference_losses.py.

The reference is the policy with its adapter disabled under LoRA/QLoRA (one backbone) and a frozen
copy of the starting model under full fine-tuning; ORPO and SimPO have none. `dpo.precompute_ref_log_probs`
computes the reference log-probs of every pair once, before the first step, in fixed batches in
data order, and drops the full-FT copy: each step then runs the policy forward only. A resumed
run recomputes them the same way (the reference never trains), so they are not checkpointed.
Dropout is off in the policy (as TRL's DPOTrainer does by default) so that at step 0 the policy's
log-probs are the reference's exactly. `data.padding_mode: pack` packs a micro-batch's sides into
rows of train.seq_length with the block-causal collator (no side sees another), else each side
is a right-padded row.

Logged: train/loss, train/accuracy (implicit reward of chosen > rejected), train/margin,
dpo/rewards_chosen, dpo/rewards_rejected (ORPO also dpo/nll, dpo/log_odds), and the same on the
held-out pairs as eval/loss, eval/accuracy, eval/margin, eval/rewards_chosen, eval/rewards_rejected.
The flow, checkpoint/resume, trackers, RELAY_STOP_AFTER_STEP=k and export are the engine's.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from data_formats.collate import AnswerPairCollator, PackedPairCollator
from data_formats.datasets import build_preference_data
from data_formats.render import template_jinja
from pipeline.algorithms import preference as pref
from pipeline.config import PreferenceDataConfig, StageConfig
from pipeline.engine.held_out import ratio
from pipeline.engine.stage_main import main
from pipeline.engine.steps import rank_mean
from pipeline.modeling.models import eval_mode
from pipeline.rl.reference_stage import ReferenceStage

log = logging.getLogger("relay.dpo")


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class DPOData(PreferenceDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/rm/train.jsonl"])
    """Preference pairs: {question, response_chosen, response_rejected}, {prompt, chosen, rejected} or chat lists."""
    eval: list[str] = field(default_factory=list)
    """Held-out pairs for eval/loss, eval/accuracy, eval/margin and the eval rewards. None by default
    (data.eval_fraction carves them off `train`)."""


@dataclass
class DPOSection:
    loss_type: str = "sigmoid"
    """sigmoid (DPO) | ipo | hinge | robust | exo_pair | nca_pair | bco_pair | sppo_hard | aot |
    aot_unpaired | apo_zero | apo_down | discopop | sigmoid_norm (TRL 1.16's names and math) | orpo |
    simpo (both reference-free). Formulas: pipeline/algorithms/preference.py."""
    beta: float = 0.1
    """DPO's β (the KL strength), IPO's τ, ORPO's λ (the weight of the odds-ratio term), SimPO's β."""
    label_smoothing: float = 0.0
    """The assumed share of flipped labels ε in [0, 0.5): sigmoid (conservative DPO), robust, aot,
    aot_unpaired, simpo; exo_pair needs it > 0 (EXO suggests 1e-3). Refused with other losses."""
    discopop_tau: float = 0.05
    """discopop only: the temperature τ of its mix of logistic and exponential losses (TRL's default)."""
    simpo_gamma: float = 0.5
    """simpo only: the target reward margin γ (TRL's CPOConfig.simpo_gamma)."""
    cpo_alpha: float = 0.0
    """simpo only: weight of the chosen answers' NLL (CPO-SimPO); 0 is the SimPO paper's loss.
    TRL's CPOConfig defaults to 1.0: set 1.0 to match it."""
    precompute_ref_log_probs: bool = False
    """Compute the reference log-probs of every pair once before training (one forward per step saved)."""

    def problems(self, key: str = "dpo") -> list[str]:
        out = []
        spec = pref.LOSSES.get(self.loss_type)
        if spec is None:
            out.append(f"{key}.loss_type: {self.loss_type!r} is not one of {', '.join(map(repr, pref.LOSS_TYPES))}")
        if not self.beta > 0:
            out.append(f"{key}.beta: must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            out.append(f"{key}.label_smoothing: must be in [0, 0.5), got {self.label_smoothing}")
        if not self.discopop_tau > 0:
            out.append(f"{key}.discopop_tau: must be > 0, got {self.discopop_tau}")
        if self.cpo_alpha < 0:
            out.append(f"{key}.cpo_alpha: must be >= 0, got {self.cpo_alpha}")
        if spec is not None:
            out += loss_option_problems(self, spec, key)
        if self.precompute_ref_log_probs and self.loss_type in pref.REFERENCE_FREE:
            out.append(f"{key}.precompute_ref_log_probs: the {self.loss_type} loss has no reference model")
        return out


def loss_option_problems(section: DPOSection, spec: pref.LossSpec, key: str) -> list[str]:
    """One line per loss option set away from its default that `spec`'s loss does not read, and the
    loss's own checks (exo_pair's missing label smoothing)."""
    out = []
    for name in ("label_smoothing", "discopop_tau", "simpo_gamma", "cpo_alpha"):
        if getattr(section, name) != getattr(DPOSection, name) and name not in spec.options:
            readers = [n for n, s in pref.LOSSES.items() if name in s.options]
            out.append(
                f"{key}.{name}: only the {', '.join(readers)} loss(es) read it (loss_type is {section.loss_type!r})"
            )
    return out + spec.problems(section, key)


@dataclass
class DPOConfig(StageConfig):
    output_dir: str = "outputs/dpo"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the tuned policy), summary.json."""
    data: DPOData = field(default_factory=DPOData)
    dpo: DPOSection = field(default_factory=DPOSection)


# ------------------------------------------------------------------------------------------
# The stage
# ------------------------------------------------------------------------------------------


class DPOStage(ReferenceStage):
    name = "dpo"
    config_class = DPOConfig
    evaluates_at_start = True

    def __init__(self, cfg: DPOConfig):
        super().__init__(cfg)
        self.precomputed: dict[str, torch.Tensor] = {}
        """split -> [N, 2] reference log-probs (chosen, rejected) of every pair, once computed."""

    def problems(self) -> list[str]:
        out = []
        if self.cfg.data.margin_field:
            out.append("data.margin_field: DPO has no per-pair margin (a reward-model key)")
        return out

    def build_data(self) -> list[str]:
        """The tokenised pairs (the RM's: data_formats.datasets.build_preference_data)."""
        cfg, tok = self.cfg, self.tokenizer
        template = self.data_template()
        stats: dict = {}
        self.train_samples = build_preference_data(cfg.data, tok, template, cfg.train.seq_length, "train", stats=stats)
        # Tool conversations in the default layout: the saved template must render them as trained.
        self.chat_template = template_jinja(template, tok, tools=stats.get("tool_conversations", 0) > 0)
        if cfg.data.has_eval:
            self.eval_samples = build_preference_data(cfg.data, tok, template, cfg.train.seq_length, "eval")
        if cfg.data.padding_mode == "pack":
            self.collator = PackedPairCollator(tok.pad_token_id, cfg.train.seq_length, cfg.model.attn_implementation)
        else:
            self.collator = AnswerPairCollator(tok.pad_token_id)
        log.info("dpo: %d training pair(s), %d eval pair(s)", len(self.train_samples), len(self.eval_samples))
        return self.fill_problems(len(self.train_samples), "pair(s)")

    def build_model(self) -> torch.nn.Module:
        """The policy; under full fine-tuning with a reference, also its frozen starting copy."""
        cfg = self.cfg
        if cfg.model.finetuning == "full" and cfg.dpo.loss_type not in pref.REFERENCE_FREE:
            self.load_reference()
        return super().build_model()

    # ---- the reference ---------------------------------------------------------------------

    def precompute(self) -> None:
        """Reference log-probs of every train and eval pair, in fixed batches of train.batch_size in
        data order (so a resumed run gets the same values), then drop the full-FT copy."""
        size = self.cfg.train.batch_size
        for split, samples in (("train", self.train_samples), ("eval", self.eval_samples)):
            rows = [
                self.reference_logps(self.collate(self.collator, samples, range(i, min(i + size, len(samples)))))
                for i in range(0, len(samples), size)
            ]
            self.precomputed[split] = (
                torch.cat([torch.stack(r.chunk(2), dim=1) for r in rows]).cpu() if rows else torch.zeros(0, 2)
            )
        log.info(
            "dpo: reference log-probs precomputed for %d train and %d eval pair(s)",
            len(self.train_samples),
            len(self.eval_samples),
        )
        self.reference, self.frozen_engines = None, []

    def batch_reference(self, split: str, indices: Sequence[int], batch: dict) -> Optional[torch.Tensor]:
        """[2B] reference sums of a batch (chosen then rejected), None for a reference-free loss."""
        if self.cfg.dpo.loss_type in pref.REFERENCE_FREE:
            return None
        if not self.cfg.dpo.precompute_ref_log_probs:
            return self.reference_logps(batch)
        if split not in self.precomputed:
            self.precompute()
        rows = self.precomputed[split][list(indices)].to(batch["input_ids"].device)
        return torch.cat([rows[:, 0], rows[:, 1]])

    # ---- steps -------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this rank's equal-sized micro-batches (the mean of per-batch
        means is the pair mean); figures averaged over pairs and ranks.

        Raises:
            NonFiniteError: loss or gradients not finite (the optimizer has not stepped).
        """
        acc = self.accelerator
        groups = self.next_sample_indices()
        sums: dict[str, float] = {}

        def micro_batch(index: int) -> torch.Tensor:
            batch = self.collate(self.collator, self.train_samples, groups[index])
            ref = self.batch_reference("train", groups[index], batch)
            logps, counts = pref.sequence_logps(self.model, batch, acc)
            loss, figures = pref.pair_losses(self.cfg.dpo, logps, counts, ref)
            acc.backward(loss)
            for key, values in figures.items():
                sums[key] = sums.get(key, 0.0) + float(values.float().mean()) / len(groups)
            return loss

        grad_norm = self.optimizer_step(len(groups), micro_batch)
        m = rank_mean(sums, acc)
        out = {
            "train/loss": m["loss"],
            "train/accuracy": m["accuracy"],
            "train/margin": m["margin"],
            "train/grad_norm": grad_norm,
            "dpo/rewards_chosen": m["rewards_chosen"],
            "dpo/rewards_rejected": m["rewards_rejected"],
        }
        out.update({f"dpo/{k}": m[k] for k in ("nll", "log_odds") if k in m})
        return out

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/loss, eval/accuracy, eval/margin, eval/rewards_chosen, eval/rewards_rejected: means
        over the held-out pairs of every rank (the padding batches of a short rank not counted)."""
        if not self.eval_samples:
            return None

        def figures(indices: list[int]) -> dict:
            batch = self.collate(self.collator, self.eval_samples, indices)
            ref = self.batch_reference("eval", indices, batch)
            logps, tokens = pref.sequence_logps(self.model, batch, self.accelerator)
            values = pref.pair_losses(self.cfg.dpo, logps, tokens, ref)[1]
            return {"pairs": len(indices), **{k: v.double().sum() for k, v in values.items()}}

        with eval_mode(self.model):
            sums = self.held_out(figures)
        out = {key: ratio(sums, key, "pairs") for key in sums}
        return {
            "eval/loss": out["loss"],
            "eval/accuracy": out["accuracy"],
            "eval/margin": out["margin"],
            "eval/rewards_chosen": out["rewards_chosen"],
            "eval/rewards_rejected": out["rewards_rejected"],
        }

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        return {
            "loss": f"{figures['train/loss']:.4f}",
            "acc": f"{figures['train/accuracy']:.2f}",
            "margin": f"{figures['train/margin']:.3f}",
        }

    def summary(self) -> dict:
        return {
            **self.history.pick(
                train_loss_first="train/loss:first",
                train_loss_last="train/loss",
                train_accuracy_last="train/accuracy",
                eval_loss_first="eval/loss:first",
                eval_loss_last="eval/loss",
                eval_accuracy="eval/accuracy",
                eval_margin="eval/margin",
                eval_rewards_chosen="eval/rewards_chosen",
                eval_rewards_rejected="eval/rewards_rejected",
            ),
            "loss_type": self.cfg.dpo.loss_type,
            **self.run_figures(),
        }


if __name__ == "__main__":
    raise SystemExit(main(DPOStage))
