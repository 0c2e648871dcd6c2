"""Per-token estimators of KL(policy || reference) from samples of the policy (Schulman's), a
registry by name: PPO's reward penalty reads `ppo.kl_estimator`'s entry, GRPO's KL term is k3 (as
TRL's), PPO's held-out KL k1. Adding an estimator is one entry here and one test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class KLEstimator:
    """One estimator, as a function of each sampled token's log-ratio r = log p - log q."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    doc: str
    """One line for the help: what it is and how it behaves."""


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": KLEstimator(lambda r: r, "r = log p - log q: unbiased, can be negative"),
    "k3": KLEstimator(lambda r: torch.expm1(-r) + r, "(q/p - 1) - log(q/p): unbiased, always >= 0, lower variance"),
}
"""The estimators by name; the config check and `kl_per_token` read this table."""


def kl_per_token(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy by the estimator
    `KL_ESTIMATORS[estimator]` (k1 = log p - log q, k3 = (q/p - 1) - log(q/p)).

    Raises:
        ValueError: unknown estimator.
    """
    entry = KL_ESTIMATORS.get(estimator)
    if entry is None:
        raise ValueError(f"kl estimator {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
    return entry.fn(logp - ref_logp)
