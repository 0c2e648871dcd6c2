"""The base of the stages that train a policy against a frozen reference (DPO, KTO): the
reference is the policy with its LoRA adapter disabled, or, under full fine-tuning, a frozen copy
of the starting model (under ZeRO-3 partitioned like the policy, in a DeepSpeed engine of its own);
its summed answer log-probs; train mode without dropout (at step 0 the
policy's log-probs equal the reference's, and a step is deterministic). A stage subclasses it
as the sampling RL stages subclass `PolicyStage`; no stage imports another stage."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from pipeline.algorithms import preference as pref
from pipeline.engine.stage import Stage
from pipeline.modeling.models import adapter_disabled, eval_mode, load_model, train_without_dropout


class ReferenceStage(Stage):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.reference: Optional[torch.nn.Module] = None
        """The frozen copy of the starting model (full fine-tuning, while it is needed), else None."""

    def load_reference(self) -> None:
        """The frozen starting copy, on the accelerator's device (full fine-tuning: no adapter to disable)."""
        self.reference = (
            load_model(self.cfg.model, None, kind="causal", tokenizer=self.tokenizer).requires_grad_(False).eval()
        )
        self.reference.to(self.accelerator.device)

    def frozen_copies(self) -> list[torch.nn.Module]:
        return [self.reference] if self.reference is not None else []

    def train_mode(self) -> None:
        """Train mode (gradient checkpointing runs) without dropout: at step 0 the policy's
        log-probs equal the reference's, and a step is deterministic."""
        train_without_dropout(self.model)

    @torch.no_grad()
    def reference_logps(self, batch: dict) -> torch.Tensor:
        """Summed answer log-probs of the reference, one per answer row of `batch`: the frozen copy,
        or the policy with its adapter disabled (eval mode: no dropout)."""
        if self.reference is not None:
            return pref.sequence_logps(self.reference, batch, self.accelerator)[0]
        policy = self.accelerator.unwrap_model(self.model)
        with adapter_disabled(policy), eval_mode(policy):
            return pref.sequence_logps(policy, batch, self.accelerator)[0]

    def export(self, summary: dict) -> Optional[Path]:
        self.reference, self.frozen_engines = None, []  # the merge loads the base again: not beside a second copy
        return super().export(summary)
