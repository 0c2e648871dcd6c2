"""From rewards to advantages for GRPO-style training (pure functions on [N] tensors; groups are
consecutive runs of `group_size` completions of one prompt): the estimators of
`grpo.advantage_estimator` (a registry), the two multi-reward aggregations, DAPO's overlong reward
shaping and DAPO's dynamic-sampling group filter.

A NaN reward marks an unscorable completion (every reward source returned None: "no opinion"). As in
TRL 1.16 it takes no part in any statistic (group mean and std, leave-one-out baseline, whitening)
and its advantage is 0; a statistic over fewer than two scored rewards has spread 0, so a lone
scored completion's advantage is 0 too (TRL reads NaN there and zeroes it). A NaN that an infinite
reward makes is not zeroed: it stops the step at its finite check.

References, pinned in tests/test_grpo.py and tests/test_grpo_variants.py:
- 'grpo' group baseline, `scale_rewards` and both `multi_objective_aggregation`s: TRL 1.16
  grpo_trainer.py `_generate_and_score_completions`.
- 'rloo': TRL 1.16 rloo_trainer.py (leave-one-out baseline) and verl's `compute_rloo_outcome_advantage`.
- 'reinforce_plus_plus' and 'reinforce_plus_plus_baseline': verl's
  `compute_reinforce_plus_plus_outcome_advantage` (gamma 1) and
  `compute_reinforce_plus_plus_baseline_outcome_advantage` (verl/trainer/ppo/core_algos.py).
  Their advantages are whitened over the batch's *tokens*; with one outcome reward per
  completion and gamma 1 every token of a completion has the same return, so a completion's
  advantage is one number and the token statistics are its length-weighted ones.
- overlong shaping: verl's DAPO reward manager and TRL's `get_soft_overlong_punishment`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch

ADVANTAGE_EPS = 1e-4
"""TRL's epsilon under the reward std (grpo_trainer.py: `advantages / (std_rewards + 1e-4)`)."""
WHITEN_EPS = 1e-8
"""verl's `masked_mean` and `masked_whiten` epsilons (verl/utils/torch_functional.py)."""
SCALES = ("group", "batch", "none")


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] -> [N / G, G] in float64.

    Raises:
        ValueError: N is not a multiple of group_size, or group_size < 2.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"advantages: {rewards.numel()} rewards do not form groups of {group_size} (>= 2)")
    return rewards.double().view(-1, group_size)


def nanstd(values: torch.Tensor, dim: Optional[int] = None, keepdim: bool = False) -> torch.Tensor:
    """TRL's `nanstd` (Bessel-corrected, NaN left out), but 0 rather than NaN over fewer than two
    values: every value there equals its mean, so dividing by this + eps gives the 0 that TRL's
    `nan_to_num` gives."""
    dims = tuple(range(values.dim())) if dim is None else (dim,)
    count = (~values.isnan()).sum(dims, keepdim=True)
    mean = values.nanmean(dims, keepdim=True)
    var = ((values - mean) ** 2).nansum(dims, keepdim=True) / (count - 1).clamp(min=1)
    std = var.sqrt()
    return std if keepdim else std.squeeze(dims)


def no_signal(advantages: torch.Tensor, unscorable: torch.Tensor) -> torch.Tensor:
    """`advantages` with each unscorable completion's set to 0 (TRL's final `nan_to_num`)."""
    return torch.where(unscorable, torch.zeros_like(advantages), advantages)


def _centred(rewards: torch.Tensor, group_size: int, scale: Union[str, bool], eps: float) -> torch.Tensor:
    """`group_advantages` before the unscorable completions' are set to 0 (NaN there)."""
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale not in SCALES:
        raise ValueError(f"scale_rewards {scale!r} is not one of {SCALES}")
    grouped = _groups(rewards, group_size)
    centred = grouped - grouped.nanmean(1, keepdim=True)
    if scale == "group":
        centred = centred / (nanstd(grouped, 1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (nanstd(grouped) + eps)
    return centred.view(-1).to(rewards.dtype)


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: Union[str, bool] = "group", eps: float = ADVANTAGE_EPS
) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the group's std + eps ('group', or True),
    the whole batch's std + eps ('batch', PPO Lite) or nothing ('none', or False: Dr. GRPO).
    Stds are Bessel-corrected, as TRL's `nanstd`; an all-equal group gets advantage 0. NaN rewards
    (unscorable) are left out of the means and stds and get advantage 0 (module docstring).

    Raises:
        ValueError: bad groups (see `_groups`) or an unknown scale.
    """
    return no_signal(_centred(rewards, group_size, scale, eps), rewards.isnan())


def group_std(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each group's reward std over its scored completions ([N / G]; `nanstd`: 0 below two)."""
    return nanstd(_groups(rewards, group_size), 1).to(rewards.dtype)


def leave_one_out(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each reward minus the mean of the other G - 1 rewards of its group; with unscorable
    (NaN) rewards, of its group's other scored rewards, as TRL 1.16's RLOOTrainer (0 for a lone
    scored one and for the unscorable)."""
    grouped = _groups(rewards, group_size)
    count = (~grouped.isnan()).sum(1, keepdim=True)
    baseline = (grouped.nansum(1, keepdim=True) - grouped) / (count - 1).clamp(min=1)
    centred = torch.where(count > 1, grouped - baseline, torch.zeros_like(grouped))
    return no_signal(centred.view(-1).to(rewards.dtype), rewards.isnan())


def token_whiten(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """verl's `masked_whiten` of per-token values that are constant over each completion:
    (s - mu) / sqrt(var + 1e-8), mu and var (Bessel-corrected) over all loss tokens, so each
    completion weighs its `lengths` (one with no loss token takes no part but is whitened too; an
    unscorable one, NaN, takes no part and gets 0). With fewer than two loss tokens (every
    completion masked as truncated, say) the variance is undefined (verl refuses) and nothing can
    be learned: the advantages are 0.
    """
    unscorable = scores.isnan()
    s = scores.double().masked_fill(unscorable, 0.0)
    n = lengths.double().masked_fill(unscorable, 0.0)
    total = n.sum()
    if total < 2:
        return torch.zeros_like(scores)
    mean = (s * n).sum() / (total + WHITEN_EPS)
    var = ((s - mean) ** 2 * n).sum() / (total + WHITEN_EPS) * total / (total - 1)
    return no_signal(((s - mean) * torch.rsqrt(var + WHITEN_EPS)).to(scores.dtype), unscorable)


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: `fn(rewards [N], loss tokens per completion [N], group_size,
    scale_rewards) -> [N]`, whether it honours `grpo.scale_rewards` (the others scale their own way)
    and whether it has a group baseline (without one, a group of equal rewards still has
    advantages, so dynamic sampling would drop what it learns from). The config checks read these."""

    fn: Callable[[torch.Tensor, torch.Tensor, int, str], torch.Tensor]
    scales_rewards: bool = False
    group_baseline: bool = True

    def __call__(self, rewards: torch.Tensor, lengths: torch.Tensor, group_size: int, scale: str) -> torch.Tensor:
        return self.fn(rewards, lengths, group_size, scale)


ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(lambda r, lengths, g, scale: group_advantages(r, g, scale), scales_rewards=True),
    "rloo": Estimator(lambda r, lengths, g, scale: leave_one_out(r, g)),
    "reinforce_plus_plus": Estimator(lambda r, lengths, g, scale: token_whiten(r, lengths), group_baseline=False),
    "reinforce_plus_plus_baseline": Estimator(
        lambda r, lengths, g, scale: token_whiten(_centred(r, g, "none", ADVANTAGE_EPS), lengths)
    ),
}
"""Estimator name -> entry: adding one is this entry and its test."""


def normalize_then_sum(per_source: torch.Tensor, weights: Sequence[float], group_size: int) -> torch.Tensor:
    """GDPO (TRL's multi_objective_aggregation 'normalize_then_sum'): each reward source ([N, K]
    columns) normalised within its group by its group std + 1e-4, the weighted sum of those, then
    normalised over the batch; the result is the advantage ([N]). A source's None (NaN) is left out
    of its group's mean and std and of the sum (TRL's nanmean, nanstd, nansum); a completion no
    source scored is left out of the batch's mean and std and gets advantage 0."""
    cols = per_source.double()
    grouped = cols.view(-1, group_size, cols.shape[1])
    mean = grouped.nanmean(1, keepdim=True)
    per = ((grouped - mean) / (nanstd(grouped, 1, keepdim=True) + ADVANTAGE_EPS)).view_as(cols)
    unscorable = cols.isnan().all(1)
    summed = no_signal(per, cols.isnan()) @ torch.tensor(list(weights), dtype=torch.float64)
    summed = summed.masked_fill(unscorable, math.nan)
    centred = (summed - summed.nanmean()) / (nanstd(summed) + ADVANTAGE_EPS)
    return no_signal(centred, unscorable).to(per_source.dtype)


def _sum_then_normalize(total, per_source, weights, lengths, group_size, *, estimator, scale):
    return ESTIMATORS[estimator](total, lengths, group_size, scale)


def _normalize_then_sum(total, per_source, weights, lengths, group_size, *, estimator, scale):
    return normalize_then_sum(per_source, weights, group_size)


AGGREGATIONS = {"sum_then_normalize": _sum_then_normalize, "normalize_then_sum": _normalize_then_sum}
"""aggregation(total [N], per-source rewards [N, K], K weights, loss tokens [N], group_size, *,
estimator, scale) -> advantages [N] (TRL's multi_objective_aggregation)."""


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_length - buffer tokens, then falling linearly
    to -factor at max_length (verl's `overlong_buffer`; TRL's soft_punish_cache with factor 1)."""
    exceed = lengths.double() - (max_length - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0).to(torch.float32)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: True for each group whose scored (non-NaN) rewards are not
    all equal (a group of equal rewards has zero advantage under every group baseline: nothing to
    learn; nor has one with fewer than two scored) ([N / G] bool)."""
    grouped = _groups(rewards, group_size)
    unscorable = grouped.isnan()
    highest = grouped.masked_fill(unscorable, -math.inf).max(1).values
    lowest = grouped.masked_fill(unscorable, math.inf).min(1).values
    return (highest - lowest) > 0
