"""GRPO's policy losses: a registry of `grpo.loss_type`s, each a per-token rule and an aggregation
(pure functions on [B, T] tensors), the importance weights they share (token or sequence level,
GSPO), and the high-entropy token filter.

Every loss type is TRL 1.16's (trl/trainer/grpo_trainer.py, `GRPOTrainer._compute_loss` and
`get_gamma_weights`/`get_high_entropy_mask`); tests/test_grpo.py and tests/test_grpo_variants.py
call TRL's own `_compute_loss` on the same tensors. What Relay adds: a micro-batch's loss is its
*share* of the optimizer step's loss (`Totals` counts the step over every micro-batch and rank),
so summing the shares gives the step's loss whatever the micro-batch split; for the loss types
TRL normalises per micro-batch ('grpo', 'sapo', 'bnpo', 'dr_grpo', 'luspo') that share equals
TRL's micro-batch loss divided by its gradient-accumulation steps (equal micro-batches, as Relay's).

Adding a loss type is one `LossType` entry and one test. PPO's clipped surrogate is this table's
'dapo' entry (pipeline/algorithms/rl.py `policy_loss`, `PPO_LOSS_TYPE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pipeline.algorithms.kl import kl_per_token


@dataclass(frozen=True)
class Objective:
    """The loss's hyper-parameters (TRL's GRPOConfig defaults); built from the `grpo:` section."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    delta: Optional[float] = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class Totals:
    """The optimizer step's counts over all its micro-batches and ranks."""

    tokens: float
    """Loss tokens of the step (TRL's `num_items_in_batch`)."""
    sequences: int
    """Completions of the step."""
    max_completion_length: int = 0
    """generation.max_new_tokens ('dr_grpo's constant)."""


@dataclass
class Terms:
    """What a per-token rule reads: [B, T] log-probs, the importance weight (ratio: [B, T] at token
    level, [B, 1] at sequence level), its per-token log, advantages ([B, 1] or [B, T]), mask, and
    the mismatch correction's weight ([B, T]) for a rule that takes it itself (`LossType.corrects_inside`)."""

    logp: torch.Tensor
    ratio: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    is_weight: Optional[torch.Tensor] = None


PerToken = Callable[[Terms, Objective], "tuple[torch.Tensor, Optional[torch.Tensor]]"]
Aggregate = Callable[[torch.Tensor, torch.Tensor, Totals], torch.Tensor]


# ------------------------------------------------------------------------------------------
# Per-token rules: (loss [B, T] or [B, 1], where the rule clipped or None)
# ------------------------------------------------------------------------------------------


def clipped_ratio(t: Terms, o: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clip: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A); with `delta` the unclipped
    ratio is also capped at delta (INTELLECT-2's two-sided clip) before the min."""
    coef_2 = torch.clamp(t.ratio, 1 - o.epsilon, 1 + o.high)
    ratio = t.ratio if o.delta is None else torch.clamp(t.ratio, max=o.delta)
    loss = -torch.min(ratio * t.advantages, coef_2 * t.advantages)
    clipped = ((ratio < 1 - o.epsilon) & (t.advantages < 0)) | ((ratio > 1 + o.high) & (t.advantages > 0))
    return loss, clipped


def cispo(t: Terms, o: Objective) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M1's CISPO: -sg(min(r, epsilon_high)) A logp; the weight is clipped, never the
    gradient (epsilon_high is the cap itself, e.g. 5.0)."""
    weight = torch.clamp(t.ratio, max=o.high).detach()
    return -weight * t.advantages * t.logp, (t.ratio > o.high) & (t.advantages > 0)


def sapo(t: Terms, o: Objective) -> tuple[torch.Tensor, None]:
    """SAPO's soft gate: -sigmoid(tau (r - 1)) 4 / tau A, tau by the advantage's sign."""
    tau = torch.where(t.advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
    return -torch.sigmoid(tau * (t.ratio - 1)) * 4 / tau * t.advantages, None


@torch.no_grad()
def gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    o: Objective,
    is_weight: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """VESPO's detached per-sequence weight phi(w) = exp(lambda + k log w - lambda w) ([B, 1]),
    w the sequence's importance ratio exp(sum of clamped token log-ratios); k, lambda by the
    advantage's sign. `is_weight` (the mismatch correction, [B, T]): each token's log weight is
    added to log w (w = pi / pi_old x pi_old / pi_engine), as TRL 1.16's `get_gamma_weights` takes
    its vLLM importance-sampling ratio, summed over the loss tokens (TRL sums every position; the
    same wherever the weight is 1 outside the mask). The clamps are TRL's (each token log-ratio in
    [-20, 20], a correction's log and log w in [log 1e-8, 20])."""
    low = math.log(1e-8)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_weight is not None:
        seq = seq + (torch.clamp(torch.log(is_weight.to(seq.dtype)), low, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, low, 20.0)
    positive = advantages >= 0
    k = torch.where(positive, o.vespo_k_pos, o.vespo_k_neg)
    lam = torch.where(positive, o.vespo_lambda_pos, o.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(t: Terms, o: Objective) -> tuple[torch.Tensor, None]:
    """VESPO: -phi(w) A logp (phi from `gamma_weights`, on the token log-ratios whatever the level,
    the mismatch correction inside w)."""
    return -gamma_weights(t.advantages, t.log_ratio, t.mask, o, t.is_weight) * t.advantages * t.logp, None


# ------------------------------------------------------------------------------------------
# Aggregations: a micro-batch's share of the step's loss
# ------------------------------------------------------------------------------------------


def sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, n: Totals) -> torch.Tensor:
    """Mean over the step's completions of each one's token mean (an empty one counts as 0)."""
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n.sequences


def micro_token_mean(per_token: torch.Tensor, mask: torch.Tensor, n: Totals) -> torch.Tensor:
    """The micro-batch's token mean, weighted by its share of the step's completions (TRL's bnpo)."""
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) * mask.shape[0] / n.sequences


def constant_normaliser(per_token: torch.Tensor, mask: torch.Tensor, n: Totals) -> torch.Tensor:
    """Token sum over completions x max_completion_length (Dr. GRPO: no length in the normaliser)."""
    return (per_token * mask).sum() / (n.sequences * n.max_completion_length)


def step_token_mean(per_token: torch.Tensor, mask: torch.Tensor, n: Totals) -> torch.Tensor:
    """Token sum over every loss token of the step (DAPO's token-level mean)."""
    return (per_token * mask).sum() / max(float(n.tokens), 1.0)


def sequence_sum_mean(per_token: torch.Tensor, mask: torch.Tensor, n: Totals) -> torch.Tensor:
    """Mean over completions of each one's token sum (LUSPO: a sequence weighs its length)."""
    return (per_token * mask).sum(-1).sum() / n.sequences


def _no_problems(section, key: str) -> list[str]:
    return []


def _cispo_problems(section, key: str) -> list[str]:
    if section.epsilon_high is None or section.epsilon_high <= 1:
        return [
            f"{key}.epsilon_high: loss_type cispo caps the ratio "
            f"at epsilon_high itself; set it > 1 (e.g. 5.0), got {section.epsilon_high}"
        ]
    return []


def _luspo_problems(section, key: str) -> list[str]:
    if section.importance_sampling_level != "sequence":
        return [f"{key}.importance_sampling_level: loss_type luspo needs 'sequence' (LUSPO is length-weighted GSPO)"]
    return []


def _sapo_problems(section, key: str) -> list[str]:
    if min(section.sapo_temperature_pos, section.sapo_temperature_neg) <= 0:
        return [f"{key}.sapo_temperature_pos/neg: must be > 0"]
    return []


def _vespo_problems(section, key: str) -> list[str]:
    if section.importance_sampling_level != "token":
        return [f"{key}.importance_sampling_level: loss_type vespo weighs the whole sequence itself; leave 'token'"]
    return []


@dataclass(frozen=True)
class LossType:
    """A GRPO loss type: its per-token rule and aggregation, the loss-specific `grpo:` options it
    reads (`options`: any other one of `loss_options()` set away from its default is a config error),
    its own checks of the `grpo:` section (`problems(section, key)`, one line each), and how it takes
    the mismatch correction (`corrects_inside`: the rule reads `Terms.is_weight` itself; otherwise
    `grpo_loss` multiplies each token's policy term by it): adding a loss type is this entry and its test."""

    per_token: PerToken
    aggregate: Aggregate
    problems: Callable[[object, str], list[str]] = _no_problems
    options: tuple[str, ...] = ()
    corrects_inside: bool = False

    @property
    def clips(self) -> bool:
        """Whether the rule is PPO's clipped ratio (PPO's own loss is such an entry)."""
        return self.per_token is clipped_ratio


CLIP = ("epsilon", "epsilon_high", "delta")
SAPO = ("sapo_temperature_pos", "sapo_temperature_neg")
VESPO = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped_ratio, sequence_mean, options=CLIP),
    "bnpo": LossType(clipped_ratio, micro_token_mean, options=CLIP),
    "dr_grpo": LossType(clipped_ratio, constant_normaliser, options=CLIP),
    "dapo": LossType(clipped_ratio, step_token_mean, options=CLIP),
    "luspo": LossType(clipped_ratio, sequence_sum_mean, _luspo_problems, options=CLIP),
    "cispo": LossType(cispo, step_token_mean, _cispo_problems, options=("epsilon_high",)),
    "sapo": LossType(sapo, sequence_mean, _sapo_problems, options=SAPO),
    "vespo": LossType(vespo, step_token_mean, _vespo_problems, options=VESPO, corrects_inside=True),
}
IMPORTANCE_LEVELS = ("token", "sequence")


def loss_options() -> tuple[str, ...]:
    """Every loss-specific `grpo:` option: those the entries of LOSS_TYPES read, in entry order."""
    return tuple(dict.fromkeys(name for entry in LOSS_TYPES.values() for name in entry.options))


def importance_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log r: per token ([B, T]), or per sequence its masked mean ([B, 1], GSPO).

    Raises:
        ValueError: an unknown level.
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level {level!r} is not one of {IMPORTANCE_LEVELS}")


def high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, quantile: float, pool: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Loss tokens whose entropy is at or above the (1 - quantile) quantile of `pool` (default:
    the masked entropies; the update passes every rank's), as a bool [B, T] (Beyond the 80/20
    Rule: only the top `quantile` of tokens by entropy carry the policy gradient)."""
    if pool is None:
        threshold = masked_quantile(entropies, mask, 1 - quantile)
    elif pool.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    else:
        threshold = torch.quantile(pool.float(), 1 - quantile)
    return ((entropies * mask.float()) >= threshold) & mask.bool()


def masked_quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """`torch.quantile(values[mask.bool()], q)` (linear interpolation, as torch's default) found on
    the values' device: a boolean index needs its count on the host, a sync per call on a GPU; here
    the count stays a device tensor. No masked value: +inf (so nothing reaches it)."""
    keep = mask.bool().flatten()
    ordered = values.float().flatten().masked_fill(~keep, float("inf")).sort().values
    last = (keep.sum() - 1).clamp(min=0)
    rank = q * last.to(ordered.dtype)
    below, above = rank.floor().long(), rank.ceil().long()
    low, high = ordered.gather(0, below.view(1)), ordered.gather(0, above.view(1))
    between = torch.lerp(low, high, (rank - below.to(rank.dtype)).view(1))
    return torch.where(above == below, low, between).squeeze(0)  # an exact rank: no lerp (inf - inf is nan)


@dataclass
class GRPOLossOut:
    loss: torch.Tensor
    """The micro-batch's share of the step's loss."""
    clipfrac: torch.Tensor
    """Share of loss tokens (sequences, at sequence level) the rule clipped; 0 for sapo/vespo."""
    kl: Optional[torch.Tensor]
    """Mean k3 KL(policy || reference) per token of the micro-batch (None when beta is 0)."""
    clip_items: torch.Tensor
    """What `clipfrac` is a share of: the micro-batch's loss tokens, or its sequences at sequence
    level (a step's clipfrac over all its micro-batches weighs each by these)."""


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: Optional[float] = None,
    beta: float = 0.0,
    ref_logp: Optional[torch.Tensor] = None,
    loss_type: str = "dapo",
    num_tokens: Optional[float] = None,
    num_sequences: Optional[int] = None,
    objective: Optional[Objective] = None,
    totals: Optional[Totals] = None,
    token_filter: Optional[torch.Tensor] = None,
    is_weight: Optional[torch.Tensor] = None,
) -> GRPOLossOut:
    """The GRPO loss of one micro-batch ([B, T] log-probs and mask, [B] or [B, T] advantages):
    `LOSS_TYPES[objective.loss_type]`'s per-token rule on the importance weights, times
    `token_filter` (the high-entropy tokens) when given, plus beta * k3(policy, reference), then
    its aggregation against `totals` (default: this micro-batch is the whole step).
    `is_weight` ([B, T], no gradient): the train-inference mismatch correction
    (pipeline/algorithms/mismatch.py), where TRL 1.16 applies its vLLM importance-sampling ratio:
    multiplying each token's policy term before the KL is added, or, for a loss type that takes it
    itself (`LossType.corrects_inside`: vespo), inside its rule.

    `objective` carries every hyper-parameter; without it one is built from epsilon, epsilon_high,
    beta and loss_type. `num_tokens`/`num_sequences` fill `totals` when it is not given.

    Raises:
        ValueError: unknown loss_type or importance level, beta > 0 without ref_logp.
    """
    o = objective or Objective(loss_type=loss_type, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta)
    if o.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {o.loss_type!r} is not one of {tuple(LOSS_TYPES)}")
    mask = mask.to(logp.dtype)
    if totals is None:
        totals = Totals(
            float(mask.sum()) if num_tokens is None else float(num_tokens),
            logp.shape[0] if num_sequences is None else int(num_sequences),
            logp.shape[1],
        )
    adv = advantages.to(logp.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    log_ratio = logp - old_logp
    ratio = torch.exp(importance_log_weights(log_ratio, mask, o.importance_sampling_level))
    rule = LOSS_TYPES[o.loss_type]
    inside = is_weight if rule.corrects_inside else None
    per_token, clipped = rule.per_token(Terms(logp, ratio, log_ratio, adv, mask, inside), o)
    if token_filter is not None:
        per_token = per_token * token_filter.to(per_token.dtype)
    if is_weight is not None and not rule.corrects_inside:
        per_token = per_token * is_weight.to(per_token.dtype)
    kl = None
    if o.beta:
        if ref_logp is None:
            raise ValueError("grpo_loss: beta > 0 needs the reference log-probs")
        kl = kl_per_token(logp, ref_logp, "k3")
        per_token = per_token + o.beta * kl
    loss = rule.aggregate(per_token, mask, totals)
    kl_mean = None if kl is None else ((kl * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    by_sequence = clipped is not None and clipped.shape[-1] == 1
    clip_items = torch.as_tensor(float(mask.shape[0]), device=mask.device) if by_sequence else mask.sum()
    return GRPOLossOut(loss, _clipfrac(clipped, mask), kl_mean, clip_items)


def _clipfrac(clipped: Optional[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """TRL's `global_masked_mean` of the clip indicator: per token, or per sequence at [B, 1]."""
    if clipped is None:
        return torch.zeros((), dtype=mask.dtype, device=mask.device)
    if clipped.shape[-1] == 1:
        return clipped.to(mask.dtype).mean().detach()
    return ((clipped.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1.0)).detach()
