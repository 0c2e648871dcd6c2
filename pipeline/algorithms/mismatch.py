"""Train-inference mismatch: how far the rollout engine's log-probs of the sampled tokens are
from the trainer's (`logprob_diff`, logged as `rollout/logprob_diff_mean` / `_max`), and the
importance weights that correct the update for it (`CORRECTIONS`, keyed by
`generation.correction`).

Relay's own engine samples from exactly the distribution the trainer scores, so its diff is ~0
and no correction is needed (`generation.correction` defaults to 'none' there). An outside engine
(vLLM: other kernels, another summation order, bf16 on a GPU) samples from a slightly different
distribution; the update's old policy is the trainer's, so each token's loss is weighted by
w = p_trainer / p_engine, either truncated at a cap (TIS, 'tis') or zeroed outside a band
(MIS, 'mis'). The weight is a constant (no gradient) multiplying the policy term of each token,
before the KL term is added; a GRPO loss type that takes it itself (`LossType.corrects_inside`:
vespo) adds its log to the sequence's log importance weight instead, as TRL's `get_gamma_weights`.

Agreement with TRL 1.16 (trl/trainer/grpo_trainer.py: the `vllm_importance_sampling_correction`
block of `_generate_and_score_completions`, modes 'token_truncate' and 'token_mask', and the
weight's place in `_compute_loss`) is pinned in tests/test_mismatch.py and, for every loss type,
tests/test_objectives_peers.py.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

Correction = Callable[[torch.Tensor, float, Optional[float]], torch.Tensor]
"""correction(log_ratio [B, T], cap, floor) -> the per-token weight [B, T]."""


def truncated_weights(log_ratio: torch.Tensor, cap: float, floor: Optional[float]) -> torch.Tensor:
    """TIS: exp(log_ratio) clamped to [floor, cap] (floor None: no lower bound)."""
    return log_ratio.exp().clamp(min=floor, max=cap)


def masked_weights(log_ratio: torch.Tensor, cap: float, floor: Optional[float]) -> torch.Tensor:
    """MIS: exp(log_ratio) where it lies within [floor, cap], 0 (the token drops out) elsewhere."""
    ratio = log_ratio.exp()
    outside = (ratio > cap) | (ratio < (floor if floor is not None else -math.inf))
    return ratio.masked_fill(outside, 0.0)


CORRECTIONS: dict[str, Optional[Correction]] = {"none": None, "tis": truncated_weights, "mis": masked_weights}
"""`generation.correction`: none, tis (token-level truncated importance sampling), mis (masked)."""


def correction_weights(
    name: str,
    trainer_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float,
    floor: Optional[float] = None,
) -> Optional[torch.Tensor]:
    """The per-token weight [B, T] that `name` puts on each token's loss (None for 'none').
    Tokens outside `mask`, and tokens the engine gave no log-prob (NaN), get ratio 1.

    Raises:
        KeyError: an unknown name (config checking refuses it before this runs).
    """
    correction = CORRECTIONS[name]
    if correction is None:
        return None
    log_ratio = torch.nan_to_num((trainer_logp - engine_logp) * mask, nan=0.0)
    return correction(log_ratio, cap, floor).detach()


def logprob_diff(trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of |engine - trainer| log-prob over the sampled tokens in `mask`; tokens the
    engine gave no log-prob (NaN) are left out rather than counted as 0 (that would understate it)."""
    delta = (trainer_logp - engine_logp).abs()
    delta = delta[mask.bool() & ~delta.isnan()]
    if delta.numel() == 0:
        return 0.0, 0.0
    return float(delta.mean()), float(delta.max())


def engine_logprob_matrix(responses: list[list[int]], engine: list[list[float]], width: int) -> torch.Tensor:
    """The engine's per-token log-probs laid out as a rollout's responses ([B, width], NaN beyond
    each response: `assemble` cut them at EOS, so only their first len(response) values count).

    Raises:
        ValueError: the engine gave fewer log-probs than a response has tokens."""
    out = torch.full((len(responses), width), float("nan"), dtype=torch.float32)
    for row, (ids, values) in enumerate(zip(responses, engine)):
        if len(values) < len(ids):
            raise ValueError(f"engine log-probs: row {row} has {len(ids)} tokens but {len(values)} log-probs")
        out[row, : len(ids)] = torch.tensor(values[: len(ids)], dtype=torch.float32)
    return out
