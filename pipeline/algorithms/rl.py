"""Pure PPO math for the PPO stage: log-probs, KL estimators and controllers, GAE, whitening,
clipped losses and a running reward normaliser.

Every function works on `[B, T]` tensors of response tokens with a `mask` (1 on real response
tokens, 0 on padding after the end). Nothing here touches a model, so each piece is unit-tested
against hand-computed values (tests/test_rl.py).

Written here rather than imported: TRL removed its PPO implementation (1.13) and its remaining
helpers are private; these few formulas are short and we want them stable under our own tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pipeline.algorithms.grpo_losses import LOSS_TYPES, Objective, Terms
from pipeline.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_per_token  # noqa: F401 - PPO's math names them

PPO_LOSS_TYPE = "dapo"
"""PPO's policy loss in the table GRPO's `loss_type` picks from: the clipped ratio, a token mean over
the optimizer step (TRL's name for that normalisation is DAPO's)."""


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under `logits` ([B, T, V], [B, T] -> [B, T]), computed in fp32."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, 2, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution ([B, T, V] -> [B, T]), in fp32."""
    logits = logits.float()
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Mean of `x` where `mask` is 1. `check=False`: the caller has made sure the mask selects
    something (where reading it is free, on the host), and the check's read of the device is saved.

    Raises:
        ValueError: the mask selects nothing (the mean is undefined), when `check`.
    """
    mask = mask.to(x.dtype)
    total = mask.sum()
    if check and total.item() == 0:
        raise ValueError("masked_mean: the mask selects no element")
    return (x * mask).sum() / total


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` where `mask` is 1 (Bessel-corrected when `unbiased`).

    Raises:
        ValueError: the mask selects fewer than 2 elements with `unbiased`.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum().item()
        if n < 2:
            raise ValueError(f"masked_var: an unbiased variance needs >= 2 elements, the mask selects {n:g}")
        var = var * n / (n - 1)
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """`x` scaled to unit variance (and zero mean when `shift_mean`) over the masked elements;
    masked-out positions come back as 0.

    `all_reduce` (a sum over ranks, `pipeline.engine.steps.all_reduce_sum`) makes the mean and the
    (Bessel-corrected) variance those of every rank's masked elements together, so 2 ranks of B
    rows whiten exactly as one process of 2B rows (two exact passes: the sum and count, then the
    squared deviations from the global mean). TRL's GRPOTrainer likewise normalises over the
    global batch (it gathers every process's rewards before computing advantages,
    trl/trainer/grpo_trainer.py, TRL 1.16); TRL's old PPOTrainer whitened per process.

    Raises:
        ValueError: the (global) mask selects fewer than 2 elements.
    """
    if all_reduce is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        m = mask.to(torch.float64)
        totals = all_reduce(torch.stack([(x.double() * m).sum(), m.sum()]))
        n = float(totals[1])
        if n < 2:
            raise ValueError(
                f"masked_whiten: an unbiased variance needs >= 2 elements, the mask selects {n:g} over all ranks"
            )
        mean64 = totals[0] / n
        var64 = all_reduce(((x.double() - mean64) ** 2 * m).sum().view(1))[0] / (n - 1)
        mean, var = mean64.to(x.dtype), var64.to(x.dtype)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(out.dtype)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Keep the coefficient; return it."""
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the observed KL towards `target`.

    coef <- coef * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)
    where `n_steps` is the number of samples (episodes) behind the KL measurement.
    """

    def __init__(self, init: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target!r}, {horizon!r}")
        self.value, self.target, self.horizon = float(init), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move the coefficient after observing `current_kl` over `n_steps` samples; return it."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), float(state["horizon"])


def make_kl_controller(init: float, target: Optional[float], horizon: float):
    """A fixed controller when `target` is None, else Ziegler's adaptive one.

    Raises:
        ValueError: adaptive settings out of range.
    """
    return FixedKLController(init) if target is None else AdaptiveKLController(init, target, horizon)


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of `mask` ([B, T] -> [B]), wherever it lies: a tool
    rollout's mask has gaps (inserted tool results are 0), so a row's count of ones minus one is
    not its last trained token.

    Raises:
        ValueError: a row has no 1 (an empty response).
    """
    keep = mask.bool()
    empty = ~keep.any(1)
    if empty.any():
        raise ValueError(f"last_index: rows {torch.nonzero(empty).flatten().tolist()} have an empty mask")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(keep)
    return torch.where(keep, positions, -1).max(1).values


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL at every response token, plus the sequence score on the
    last response token (the usual RLHF shaping). Padding gets 0.

    Raises:
        ValueError: a row has an empty mask.
    """
    rewards = -kl_coef * kl * mask.to(kl.dtype)
    idx = last_index(mask)
    rewards[torch.arange(rewards.shape[0]), idx] += scores.to(rewards.dtype)
    return rewards


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded responses.

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, with V and A
    zero past the end of each response (the episode ends there). Returns (advantages, returns =
    advantages + values), both zero on padding.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    T = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        out.append(last)
    advantages = torch.stack(out[::-1], dim=1)
    return advantages, (advantages + values) * mask


def gae_over_turns(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` over each row's trained (sampled) tokens only: the tokens Relay inserted between
    turns (tool results, template text) are the environment's step, not the policy's, so the next
    value after a call's last token is the first token of the next sampled turn's, not 0 (plain GAE
    would end the episode at every tool call). Equal to `gae` where a row's mask has no gaps;
    advantages and returns are 0 on untrained positions."""
    keep = mask.bool()
    width = int(keep.sum(1).max()) if keep.any() else 0
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]  # trained positions first, in order
    packed_mask = torch.gather(keep, 1, order)
    advantages, returns = gae(torch.gather(rewards, 1, order), torch.gather(values, 1, order), packed_mask, gamma, lam)
    out_adv, out_ret = torch.zeros_like(rewards, dtype=advantages.dtype), torch.zeros_like(rewards, dtype=returns.dtype)
    out_adv.scatter_(1, order, advantages * packed_mask)
    out_ret.scatter_(1, order, returns * packed_mask)
    return out_adv, out_ret


@dataclass
class PolicyLossOut:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    weight: Optional[torch.Tensor] = None,
    check: bool = True,
) -> PolicyLossOut:
    """PPO's clipped surrogate: mean over tokens of max(-A r, -A clip(r, 1-eps, 1+eps)), with
    r = exp(logp - old_logp): the per-token rule of the policy-loss table's `PPO_LOSS_TYPE` entry
    (pipeline/algorithms/grpo_losses.py), with a symmetric clip. Also the share of tokens where
    clipping was active and the k3 approximate KL(old || new) (neither weighted). `ppo_update`
    turns the micro-batch's token mean into its share of the step's token mean, the entry's
    aggregation.

    `weight` ([B, T], no gradient): the train-inference mismatch correction
    (pipeline/algorithms/mismatch.py) multiplies each token's clipped surrogate before the token
    mean, where verl applies `rollout_is_weights` (verl/trainer/ppo/core_algos.py,
    compute_policy_loss_vanilla); None: unweighted. `check`: as `masked_mean`'s.

    Raises:
        ValueError: the mask selects nothing (when `check`).
    """
    log_ratio = logp - old_logp
    terms = Terms(logp, torch.exp(log_ratio), log_ratio, advantages, mask)
    per_token, was_clipped = LOSS_TYPES[PPO_LOSS_TYPE].per_token(terms, Objective(PPO_LOSS_TYPE, epsilon=clip))
    if weight is not None:
        per_token = per_token * weight
    loss = masked_mean(per_token, mask, check)
    clipfrac = masked_mean(was_clipped.float(), mask, False)
    # Samples come from the old policy, so k3 of KL(old || new) is (r - 1) - log r.
    approx_kl = masked_mean(torch.expm1(log_ratio) - log_ratio, mask, False)
    return PolicyLossOut(loss, clipfrac.detach(), approx_kl.detach())


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: 0.5 * mean(max((V - R)^2, (V_clipped - R)^2)) with V_clipped kept
    within `clip` of the rollout's values; and the share of tokens where the clipped term won.
    `check`: as `masked_mean`'s.

    Raises:
        ValueError: the mask selects nothing (when `check`).
    """
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask, check)
    clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask, False)
    return loss, clipfrac.detach()


class RunningMoments:
    """Running mean and std of every reward seen (Chan et al.'s parallel update), so rewards are
    normalised by statistics of the whole run rather than one noisy batch. Resumable through
    `state_dict`.

    Variance: the population one, var = sum (x - mean)^2 / N, and std = sqrt(var) (no Bessel
    correction). This matches the RM stage's stored stats (stages/reward.py `reward_stats`:
    `std(unbiased=False)`), so `RunningMoments(mean, std, n)` built from them continues exactly
    as if those n scores had been seen here. TRL's RunningMoments (trl/trainer/utils.py up to
    0.11, e.g. huggingface/trl v0.11.4 = 1f8ba929, later trl/experimental/bco/bco_trainer.py)
    keeps the same population `var`, but the `std` it scales PPO scores by (PPOTrainer's
    use_score_scaling) is Bessel-corrected, sqrt(var * N / (N - 1)), and it starts from count
    1e-24 with var 1. For N rewards our std is TRL's times sqrt((N - 1) / N) (0.9995 at
    N = 1000). Pinned in tests/test_rl.py.
    """

    def __init__(self, mean: float = 0.0, std: float = 1.0, count: float = 0.0):
        self.mean, self.var, self.count = float(mean), float(std) ** 2, float(count)

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor) -> None:
        """Fold a batch of scalars into the statistics (call with every process's rewards
        gathered, so each process holds the same statistics).

        Raises:
            ValueError: an empty batch.
        """
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            raise ValueError("RunningMoments.update: empty batch")
        batch_mean = x.mean().item()
        batch_var = x.var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.count = total

    def normalise(self, x: torch.Tensor, clip: Optional[float] = None, eps: float = 1e-8) -> torch.Tensor:
        """(x - mean) / std, then clipped to [-clip, clip] when `clip` is set."""
        out = (x - self.mean) / (self.std + eps)
        return out.clamp(-clip, clip) if clip else out

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])
