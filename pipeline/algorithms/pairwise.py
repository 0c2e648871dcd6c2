"""The RM stage's math (the stage is stages/reward.py): the pairwise loss, the scores of a
`data_formats.collate.PairCollator` batch, and the reward statistics PPO's normaliser reads.

Loss: -logsigmoid(r_chosen - r_rejected - margin) (+ `center_coef` * mean((r_chosen +
r_rejected)^2), InstructGPT/TRL's centring)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.engine.fsdp import runs_unwrapped
from pipeline.modeling.opening import opening_sequence_scores
from pipeline.modeling.scoring import sequence_scores

REWARD_STATS_KEY = "relay_reward_stats"
"""The key of the reward statistics in a merged RM's config.json."""


def pairwise_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: Optional[torch.Tensor] = None,
    center_coef: Optional[float] = None,
) -> torch.Tensor:
    """mean(-logsigmoid(r_c - r_r - margin)) + center_coef * mean((r_c + r_r)^2)."""
    diff = chosen - rejected - (margin if margin is not None else 0.0)
    loss = -F.logsigmoid(diff).mean()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).mean()
    return loss


def pair_scores(model, batch: dict, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores of a PairCollator batch. In one process the rows' shared opening
    (their chat template's system turn and the user turn's header) runs once
    (pipeline.modeling.opening); a model an engine wraps (DDP, FSDP, DeepSpeed) runs its own forward."""
    autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
    with autocast:
        scores = (
            opening_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
            if runs_unwrapped(accelerator, model)
            else None
        )
        if scores is None:
            scores = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


def stats_of(scores: torch.Tensor) -> dict:
    """The stored reward statistics: mean and population std (the variance PPO's normaliser uses)."""
    scores = scores.double()
    return {"mean": float(scores.mean()), "std": float(scores.std(unbiased=False)), "n": int(scores.numel())}


def record_stats_in_config(merged: Path, stats: dict) -> None:
    """Add `relay_reward_stats` to merged/config.json (written beside it, then renamed)."""
    path = merged / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config[REWARD_STATS_KEY] = stats
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, path)
