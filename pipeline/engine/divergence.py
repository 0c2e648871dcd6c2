"""Telling a diverged run from a training one (train.divergence): a loss that climbed to a
multiple of where it started (a LoRA run stuck at ln(vocab)), or weights that blew up. The
engine checks after every optimizer step and stops the run without publishing it
(`Diverged`); the non-finite guard (engine.steps.check_finite) catches NaN/inf before the step.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from pipeline.config.sections import DivergenceConfig
from pipeline.engine.fsdp import local_tensor


class Diverged(RuntimeError):
    """The run diverged; the message is one line for the user."""


def loss_divergence(losses: list[float], cfg: DivergenceConfig) -> Optional[str]:
    """Why the loss curve counts as diverged, or None: the mean of the last `window` losses is
    more than `loss_ratio` times the mean of the first `window` (needs 2 x window losses)."""
    w = cfg.window
    if len(losses) < 2 * w:
        return None
    first, last = sum(losses[:w]) / w, sum(losses[-w:]) / w
    if first > 0 and last > cfg.loss_ratio * first:
        return (
            f"train loss {last:.3f} over the last {w} steps is {last / first:.1f}x the first {w} steps' {first:.3f} "
            f"(train.divergence.loss_ratio {cfg.loss_ratio})"
        )
    return None


def largest_weight(params: Iterable[torch.Tensor]) -> float:
    """The largest magnitude among the given tensors (0.0 for none); of a DTensor, this rank's
    shard (the caller agrees over ranks, and a shard's max needs no communication)."""
    with torch.no_grad():
        tensors = [t for t in (local_tensor(p.detach()) for p in params) if t.numel()]
        if not tensors:
            return 0.0
        # One host read for all of them: a float() per parameter is a device sync each on a GPU.
        by_device: dict = {}
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
        peaks = [
            torch.stack([m.float() for m in torch._foreach_norm(group, float("inf"))]).max()
            for group in by_device.values()
        ]
        return float(torch.stack([p.cpu() for p in peaks]).max())


def weight_divergence(largest: float, cfg: DivergenceConfig) -> Optional[str]:
    """Why the weights count as blown up, or None."""
    if not largest <= cfg.max_weight_abs:  # also catches NaN
        return (
            f"a trainable weight reached magnitude {largest:.3g} "
            f"(train.divergence.max_weight_abs {cfg.max_weight_abs:g})"
        )
    return None
