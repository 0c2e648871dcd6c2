"""The learning rate of each optimizer step, from the schedule's shape (pipeline.config.schedule_shape:
Levanter's {[(re)warmup] -> [stable] -> [decay]} x cycles, its definitions and where Relay differs).

`lr_at(step, total_steps, cfg)` is a pure function giving the absolute LR of optimizer step
`step` (0-based: step 0 is the first update). `build_scheduler` wraps it in a LambdaLR so the
optimizer sees exactly those values and the scheduler state round-trips through checkpoints.
"""

from __future__ import annotations

import torch

from pipeline.config import TrainConfig
from pipeline.config.schedule_shape import Cycle, cycle_ends, cycles_of, decay_value

__all__ = ["Cycle", "build_scheduler", "cycle_ends", "cycles_of", "decay_value", "lr_at"]


def _lr_in_cycle(step: int, cycle: Cycle, start_lr: float, cfg: TrainConfig) -> float:
    peak = cfg.learning_rate
    t = step - cycle.start
    if t < cycle.warmup:
        return start_lr + (peak - start_lr) * t / cycle.warmup
    if t < cycle.warmup + cycle.stable:
        return peak
    # The decay's last step (t == length - 1) lands on min: progress counts steps up to it.
    progress = (t - cycle.warmup - cycle.stable) / max(cycle.decay - 1, 1)
    return decay_value(cfg.lr_schedule, peak, cfg.min_lr_ratio, progress)


def lr_at(step: int, total_steps: int, cfg: TrainConfig) -> float:
    """Absolute learning rate of optimizer step `step` (0-based) in a run of `total_steps`.

    Steps at or past the end keep the final LR.

    Raises:
        ValueError: step < 0, total_steps < 1, or bad schedule settings.
    """
    if step < 0 or total_steps < 1:
        raise ValueError(f"lr_at: need step >= 0 and total_steps >= 1, got {step}, {total_steps}")
    step = min(step, total_steps - 1)
    start_lr = 0.0
    for cycle in cycles_of(total_steps, cfg):
        if step < cycle.end:
            return _lr_in_cycle(step, cycle, start_lr, cfg)
        start_lr = _lr_in_cycle(cycle.end - 1, cycle, start_lr, cfg)
    raise AssertionError("unreachable: the last cycle ends at total_steps")


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose LR at step s is `lr_at(s, cfg.max_steps, cfg)`.

    The optimizer's initial LR must be `cfg.learning_rate` (build_optimizer sets it), because
    LambdaLR multiplies it by the returned factor.

    Raises:
        ValueError: bad schedule settings (checked once here, not at step 1000).
    """
    total = cfg.max_steps
    cycles_of(total, cfg)
    peak = cfg.learning_rate
    if peak == 0:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, total, cfg) / peak)
