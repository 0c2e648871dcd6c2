"""KTO stage: tune the SFT policy on unpaired answers labelled desirable or undesirable (KTO), no
reward model and no pairs.

    torchrun --nproc_per_node N stages/kto.py --config configs/kto.yaml [--train.max_steps 20]
    python stages/kto.py                                   # one process, bundled sample pairs, unpaired

Reads TRL's unpaired layout ({prompt, completion, label}, standard or conversational),
LLaMA-Factory's ({messages, label} as in its kto_en_demo.json; `kto_tag`) and paired preference
files, which it unpairs as TRL's KTOTrainer does (data_formats.unpaired). A sample is rendered as a
DPO side: the prompt, then the answer up to and including its end-of-turn token; its log-prob is
the sum over the answer tokens. The math (`kto.loss_type`: kto, apo_zero_unpaired) is
pipeline/algorithms/kto.py, checked against TRL 1.16's KTOTrainer in tests/test_kto.py.

Why a stage of its own rather than a DPO loss type: the data is of another kind (one answer per
sample, not a pair), a KTO micro-batch needs a second batch of mismatched prompt/answer rows for
its KL estimate, and what it logs differs; the reference handling is DPO's, inherited: the policy
with its adapter disabled under LoRA/QLoRA, a frozen copy of the starting model under full
fine-tuning, dropout off. The KL rows are built from the micro-batch drawn (each prompt with the
previous sample's answer, never one to the same question: data_formats.unpaired.kl_partners), so
the reference log-probs are not precomputed.

Logged: train/loss, train/margin (mean reward of desirable minus undesirable samples),
kto/rewards_chosen, kto/rewards_rejected, kto/kl (the KL estimate z_ref), and eval/loss,
eval/margin, eval/rewards_chosen, eval/rewards_rejected on the held-out samples. The flow,
checkpoint/resume, trackers, RELAY_STOP_AFTER_STEP=k and export are the engine's.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from data_formats.collate import Collator
from data_formats.unpaired import answer_rows, build_kto_data, kl_partner_problem, mismatched_rows
from pipeline.algorithms import kto as kto_math
from pipeline.algorithms import preference as pref
from pipeline.config import ChatDataConfig, StageConfig
from pipeline.engine.stage_main import main
from pipeline.engine.steps import all_reduce_sum
from pipeline.modeling.models import eval_mode
from pipeline.rl.reference_stage import ReferenceStage

log = logging.getLogger("relay.kto")


@dataclass
class KTOData(ChatDataConfig):
    train: list[str] = field(default_factory=lambda: ["data/sample/rm/train.jsonl"])
    """Labelled answers ({prompt, completion, label}, {messages, label}) or preference pairs (unpaired)."""
    eval: list[str] = field(default_factory=list)
    """Held-out samples for eval/loss, eval/margin and the eval rewards. None by default
    (data.eval_fraction carves them off `train`)."""


@dataclass
class KTOSection:
    loss_type: str = "kto"
    """kto | apo_zero_unpaired (TRL 1.16's KTOConfig.loss_type; formulas: pipeline/algorithms/kto.py)."""
    beta: float = 0.1
    """β: the strength of the KL penalty (TRL's default 0.1)."""
    desirable_weight: float = 1.0
    """λ_D, the weight of desirable samples' losses; the paper advises λ_D·n_D / (λ_U·n_U) in [1, 4/3]."""
    undesirable_weight: float = 1.0
    """λ_U, the weight of undesirable samples' losses."""

    def problems(self, key: str = "kto") -> list[str]:
        out = []
        if self.loss_type not in kto_math.LOSSES:
            out.append(f"{key}.loss_type: {self.loss_type!r} is not one of {', '.join(map(repr, kto_math.LOSS_TYPES))}")
        if not self.beta > 0:
            out.append(f"{key}.beta: must be > 0, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                out.append(f"{key}.{name}: must be > 0, got {getattr(self, name)}")
        return out


@dataclass
class KTOConfig(StageConfig):
    output_dir: str = "outputs/kto"
    """Everything goes here: checkpoints/, runs/, adapter/, merged/ (the tuned policy), summary.json."""
    data: KTOData = field(default_factory=KTOData)
    kto: KTOSection = field(default_factory=KTOSection)


def without_nan(figures: dict[str, float]) -> dict[str, float]:
    """`figures` less those that are NaN: a batch without desirable (or undesirable) samples has no
    mean reward for them, and TRL logs none either."""
    return {k: v for k, v in figures.items() if not (isinstance(v, float) and math.isnan(v))}


class KTOStage(ReferenceStage):
    name = "kto"
    config_class = KTOConfig
    evaluates_at_start = True

    def problems(self) -> list[str]:
        cfg, out = self.cfg, []
        spec = kto_math.LOSSES.get(cfg.kto.loss_type)
        if spec is not None and spec.needs_kl and cfg.train.batch_size < 2:
            out.append(
                f"train.batch_size: the {cfg.kto.loss_type} loss estimates its KL term from the other samples of a "
                f"micro-batch, so it needs >= 2, got {cfg.train.batch_size}"
            )
        if cfg.data.padding_mode != "padding":
            out.append(
                f"data.padding_mode: the KTO stage pads each sample to its own row (got {cfg.data.padding_mode!r})"
            )
        return out

    def build_data(self) -> list[str]:
        """The tokenised samples (data_formats.unpaired.build_kto_data)."""
        cfg, tok = self.cfg, self.tokenizer
        template = self.data_template()
        stats: dict = {}
        self.train_samples = build_kto_data(cfg.data, tok, template, cfg.train.seq_length, "train", stats=stats)
        if cfg.data.has_eval:
            self.eval_samples = build_kto_data(cfg.data, tok, template, cfg.train.seq_length, "eval")
        self.collator = Collator(tok.pad_token_id)
        advice = kto_math.weight_advice(
            stats.get("desirable", 0), stats.get("undesirable", 0), cfg.kto.desirable_weight, cfg.kto.undesirable_weight
        )
        if advice:
            log.warning(advice)
        log.info("kto: %d training sample(s), %d eval sample(s)", len(self.train_samples), len(self.eval_samples))
        problems = self.fill_problems(len(self.train_samples), "sample(s)")
        if kto_math.LOSSES[cfg.kto.loss_type].needs_kl:
            found = (
                kl_partner_problem(s, split)
                for s, split in ((self.train_samples, "train"), (self.eval_samples, "eval"))
                if s
            )
            problems += [p for p in found if p]
        return problems

    def build_model(self) -> torch.nn.Module:
        """The policy; under full fine-tuning, also its frozen starting copy (the reference)."""
        if self.cfg.model.finetuning == "full":
            self.load_reference()
        return super().build_model()

    # ---- one micro-batch ---------------------------------------------------------------------

    def micro_batch(
        self, samples: Sequence[dict], indices: Sequence[int]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, summed figures) of one micro-batch: the policy's and reference's answer log-probs,
        and, for a loss that reads it, the KL estimate from the mismatched rows (no gradient)."""
        picked = [samples[i] for i in indices]
        batch = self.collate(self.collator, answer_rows(picked), range(len(picked)))
        ref = self.reference_logps(batch)
        kl = None
        if kto_math.LOSSES[self.cfg.kto.loss_type].needs_kl:
            mismatched = self.collate(
                self.collator, mismatched_rows(samples, indices, self.cfg.train.seq_length), range(len(picked))
            )
            with torch.no_grad():
                policy_kl = pref.sequence_logps(self.model, mismatched, self.accelerator)[0]
            kl = kto_math.kl_estimate(policy_kl, self.reference_logps(mismatched), self.accelerator)
        sums = pref.sequence_logps(self.model, batch, self.accelerator)[0]
        labels = torch.tensor([s["label"] for s in picked], device=sums.device)
        loss, figures = kto_math.unpaired_losses(self.cfg.kto, sums, ref, labels, kl)
        figures["kl"] = (kl if kl is not None else torch.zeros(())).detach().cpu().reshape(())
        return loss, figures

    def reduced(self, sums: dict[str, float]) -> dict[str, float]:
        """Figure sums over ranks, then their means (kto.figure_means); kl averaged over ranks' steps."""
        keys = sorted(sums)
        totals = all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64), self.accelerator)
        total = dict(zip(keys, totals.tolist()))
        return {**kto_math.figure_means(total), "kl": total["kl"] / self.accelerator.num_processes}

    # ---- steps -------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One optimizer step over this rank's equal-sized micro-batches (the mean of per-batch
        means is the sample mean); figures summed over samples and ranks, then averaged.

        Raises:
            NonFiniteError: loss or gradients not finite (the optimizer has not stepped).
        """
        acc = self.accelerator
        groups = self.next_sample_indices()
        sums: dict[str, float] = {}

        def micro_batch(index: int) -> torch.Tensor:
            loss, figures = self.micro_batch(self.train_samples, groups[index])
            acc.backward(loss)
            for key, value in figures.items():
                sums[key] = sums.get(key, 0.0) + float(value) / (len(groups) if key == "kl" else 1)
            return loss

        grad_norm = self.optimizer_step(len(groups), micro_batch)
        m = self.reduced(sums)
        out = {
            "train/loss": m["loss"],
            "train/margin": m["margin"],
            "train/grad_norm": grad_norm,
            "kto/rewards_chosen": m["rewards_chosen"],
            "kto/rewards_rejected": m["rewards_rejected"],
            "kto/kl": m["kl"],
        }
        return without_nan(out)

    @torch.no_grad()
    def evaluate(self) -> Optional[dict[str, float]]:
        """eval/loss, eval/margin, eval/rewards_chosen, eval/rewards_rejected over the held-out samples
        of every rank (a short rank's padding batches not counted)."""
        if not self.eval_samples:
            return None
        with eval_mode(self.model):
            sums = self.held_out(lambda indices: self.micro_batch(self.eval_samples, indices)[1])
        m = kto_math.figure_means({key: float(value) for key, value in sums.items()})
        return without_nan(
            {
                "eval/loss": m["loss"],
                "eval/margin": m["margin"],
                "eval/rewards_chosen": m["rewards_chosen"],
                "eval/rewards_rejected": m["rewards_rejected"],
            }
        )

    def progress(self, figures: dict[str, float]) -> dict[str, str]:
        return {
            "loss": f"{figures['train/loss']:.4f}",
            # no margin where a step held one kind of sample (its figures leave it out, not NaN)
            "margin": f"{figures['train/margin']:.3f}" if "train/margin" in figures else "n/a",
            "kl": f"{figures['kto/kl']:.3f}",
        }

    def summary(self) -> dict:
        return {
            **self.history.pick(
                train_loss_first="train/loss:first",
                train_loss_last="train/loss",
                eval_loss_first="eval/loss:first",
                eval_loss_last="eval/loss",
                eval_margin="eval/margin",
                eval_rewards_chosen="eval/rewards_chosen",
                eval_rewards_rejected="eval/rewards_rejected",
            ),
            "loss_type": self.cfg.kto.loss_type,
            **self.run_figures(),
        }


if __name__ == "__main__":
    raise SystemExit(main(KTOStage))
