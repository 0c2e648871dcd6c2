"""Preference optimisation math (the DPO stage, stages/dpo.py): small pure functions on sequence
log-probabilities, with golden tests against TRL 1.16 in tests/test_dpo.py and
tests/test_preference_losses.py, and a batch's answer log-probs (`sequence_logps`) and losses with
their logged figures (`pair_losses`). Each `dpo.loss_type` is one pure function in the `LOSSES`
registry (the stage never branches on the name): TRL 1.16's DPOConfig.loss_type values (sigmoid,
hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down,
discopop, sigmoid_norm; not `sft`, which is the SFT stage), ORPO and SimPO; each function's
docstring gives its formula and paper.

A sequence log-prob is the sum of the answer tokens' log-probs (`answer_logps`), the answer being
the last assistant answer up to and including its end-of-turn token, as the RM scores it
(data_formats.render.render_scored). Losses are per pair ([B]); the stage takes their mean.

- `sigmoid` (DPO, Rafailov et al. 2023; with label smoothing, cDPO):
      Δ = (log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r))
      loss = -(1 - ε) log σ(βΔ) - ε log σ(-βΔ)
  TRL 1.16's `sigmoid` has no label smoothing (ε = 0); its `aot_unpaired` applies the same
  (1 - ε)/ε mixture to Δ after sorting each side over the batch, which for one pair is this loss:
  the golden test compares with both.
- `ipo` (Azar et al. 2023, Eq. 17): loss = (Δ̄ - 1/(2β))², where Δ̄ uses each side's log-ratio
  divided by its answer length (a per-token average). This is TRL's choice (confirmed with the IPO
  authors, whose reported results use it): with sums the squared loss grows with answer length,
  so β would mean something else for every data set. Relay follows it.
- `orpo` (Hong et al. 2024): reference-free. loss = NLL(chosen answer) + β·(-log σ(log odds)),
  log odds = log(p_c / (1 - p_c)) - log(p_r / (1 - p_r)) with p = exp(mean answer-token log-prob)
  (the paper's length-normalised likelihood, Eq. 4; TRL's ORPOTrainer the same). β is the paper's
  λ (TRL names it beta too). Relay's NLL is the token mean over the chosen *answer* tokens (the
  paper's L_SFT, and what Relay's SFT stage trains); TRL's ORPOTrainer averages it over prompt and
  answer tokens, which trains the model to write prompts as well.

- `simpo` (Meng et al. 2024): reference-free, on mean answer-token log-probs with a target margin
  γ (`dpo.simpo_gamma`); `dpo.cpo_alpha` adds the chosen answers' NLL as TRL's CPOTrainer does.

Implicit rewards (logged): β·(log π - log π_ref) per side for the reference-based losses (TRL's
rewards/chosen, rewards/rejected); for orpo and simpo β·(mean answer log-prob), as TRL's
ORPOTrainer and CPOTrainer log them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from data_formats.collate import IGNORE_INDEX
from pipeline.engine.steps import model_inputs
from pipeline.engine.supervised_head import head_split, labelled_token_logps


class PairLosses(NamedTuple):
    """Per pair ([B]): the loss, the implicit rewards of the chosen and rejected answers, and any
    extra figures the loss logs (ORPO's nll and log_odds), each [B]."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extra: Optional[dict] = None


class PairLogps(NamedTuple):
    """What a pair loss reads, per pair ([B]): summed answer log-probs of the policy and (None for
    a reference-free loss) the reference, and the answers' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: Optional[torch.Tensor] = None
    ref_rejected: Optional[torch.Tensor] = None
    chosen_tokens: Optional[torch.Tensor] = None
    rejected_tokens: Optional[torch.Tensor] = None


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, T-1] log-prob of each labelled token, 0 elsewhere; [N, T-1] bool mask of them).

    `labels` is aligned with the input ids (HF convention: the logits at t-1 predict labels[t]),
    IGNORE_INDEX where nothing is scored. Log-probs are computed in at least fp32.
    """
    logits, labels = logits[:, :-1, :], labels[:, 1:]
    if logits.dtype.itemsize < 4:
        logits = logits.float()
    mask = labels != IGNORE_INDEX
    picked = torch.gather(logits, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_token = picked - torch.logsumexp(logits, dim=-1)
    return torch.where(mask, per_token, torch.zeros_like(per_token)), mask


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] summed log-probs, [N] token counts) of the labelled tokens of each row (`token_logps`)."""
    return row_sums(*token_logps(logits, labels))


def row_sums(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] summed log-probs, [N] token counts) from `token_logps`'s [N, T-1] pair."""
    return per_token.sum(-1), mask.sum(-1)


def packed_answer_logps(
    logits: torch.Tensor, labels: torch.Tensor, sample_index: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """([count] summed log-probs, [count] token counts) per sample of packed rows, where
    `sample_index` [R, T] names the sample each position belongs to (-1: padding)."""
    return packed_sums(*token_logps(logits, labels), sample_index, count)


def packed_sums(
    per_token: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`packed_answer_logps` from `token_logps`'s [R, T-1] pair."""
    owner = sample_index[:, 1:]
    keep = mask & (owner >= 0)
    sums = torch.zeros(count, dtype=per_token.dtype, device=per_token.device).index_add(0, owner[keep], per_token[keep])
    counts = torch.zeros(count, dtype=torch.long, device=per_token.device).index_add(
        0, owner[keep], torch.ones_like(owner[keep])
    )
    return sums, counts


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (Mächler 2012)."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_log_odds(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor) -> torch.Tensor:
    """[B] log odds ratio of the chosen over the rejected answer from mean answer-token log-probs."""
    return (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))


def orpo_losses(
    chosen_sum: torch.Tensor,
    rejected_sum: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float,
) -> tuple[PairLosses, torch.Tensor]:
    """(per-pair odds-ratio terms -β log σ(log odds) with the rewards, [B] log odds) from summed
    answer log-probs and answer token counts. The ORPO loss adds `orpo_nll` to their mean."""
    chosen_mean = chosen_sum / chosen_tokens.clamp(min=1)
    rejected_mean = rejected_sum / rejected_tokens.clamp(min=1)
    log_odds = orpo_log_odds(chosen_mean, rejected_mean)
    return PairLosses(
        -beta * F.logsigmoid(log_odds), beta * chosen_mean.detach(), beta * rejected_mean.detach()
    ), log_odds


def orpo_nll(chosen_sum: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """ORPO's SFT term: the token-mean NLL over the chosen answers of a batch."""
    return -chosen_sum.sum() / chosen_tokens.sum().clamp(min=1)


# --------------------------------------------------------------------------------------------
# The pair losses: one pure function per `dpo.loss_type`, registered in LOSSES
# --------------------------------------------------------------------------------------------
# Every function takes the pair log-probs (`PairLogps`) and the `dpo` config section `p` (beta,
# label_smoothing, discopop_tau, simpo_gamma, cpo_alpha: only the fields its LossSpec lists) and
# returns `PairLosses`; the batch loss is the mean of `losses`. Names and math are TRL 1.16's
# (DPOTrainer._compute_loss, CPOTrainer.cpo_loss), checked on the same tensors in
# tests/test_preference_losses.py. Notation: r_c, r_r are the log-ratios log π - log π_ref of
# the chosen and rejected answers (sums over answer tokens), Δ = r_c - r_r, ε the label smoothing.


def _ratios(x: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chosen - x.ref_chosen, x.rejected - x.ref_rejected


def _dpo_rewards(x: PairLogps, p, losses: torch.Tensor) -> PairLosses:
    """The per-pair losses with DPO's implicit rewards β·r (TRL's rewards/chosen, rewards/rejected)."""
    chosen, rejected = _ratios(x)
    return PairLosses(losses, p.beta * chosen.detach(), p.beta * rejected.detach())


def _counts(x: PairLogps, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.chosen_tokens is None or x.rejected_tokens is None:
        raise ValueError(f"dpo_losses: the {name} loss needs the answers' token counts")
    return x.chosen_tokens.clamp(min=1), x.rejected_tokens.clamp(min=1)


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    """cDPO's mixture -(1 - ε) log σ(z) - ε log σ(-z)."""
    return -(1.0 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def sigmoid_loss(x: PairLogps, p) -> PairLosses:
    """DPO, with cDPO's label smoothing: -(1 - ε) log σ(βΔ) - ε log σ(-βΔ) (TRL's `sigmoid` is ε = 0)."""
    chosen, rejected = _ratios(x)
    return _dpo_rewards(x, p, _smoothed(p.beta * (chosen - rejected), p.label_smoothing))


def hinge_loss(x: PairLogps, p) -> PairLosses:
    """SLiC (Zhao et al. 2023): max(0, 1 - βΔ)."""
    chosen, rejected = _ratios(x)
    return _dpo_rewards(x, p, torch.relu(1.0 - p.beta * (chosen - rejected)))


def ipo_loss(x: PairLogps, p) -> PairLosses:
    """IPO (Eq. 17), each side's log-ratio averaged over its answer tokens (module docstring)."""
    chosen, rejected = _ratios(x)
    nc, nr = _counts(x, "ipo")
    return _dpo_rewards(x, p, (chosen / nc - rejected / nr - 1.0 / (2.0 * p.beta)) ** 2)


def exo_pair_loss(x: PairLogps, p) -> PairLosses:
    """EXO (Ji et al. 2024, Eq. 16): KL(softmax(β·r) over the pair ‖ [1 - ε, ε]); needs ε > 0."""
    chosen, rejected = _ratios(x)
    z, eps = p.beta * (chosen - rejected), torch.tensor(p.label_smoothing, dtype=chosen.dtype, device=chosen.device)
    losses = torch.sigmoid(z) * (F.logsigmoid(z) - torch.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - torch.log(eps)
    )
    return _dpo_rewards(x, p, losses)


def nca_pair_loss(x: PairLogps, p) -> PairLosses:
    """NCA (Chen et al. 2024): -log σ(βr_c) - ½ log σ(-βr_c) - ½ log σ(-βr_r)."""
    chosen, rejected = _ratios(x)
    c, r = p.beta * chosen, p.beta * rejected
    return _dpo_rewards(x, p, -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r))


def robust_loss(x: PairLogps, p) -> PairLosses:
    """Robust DPO (Chowdhury et al. 2024): (-(1 - ε) log σ(βΔ) + ε log σ(-βΔ)) / (1 - 2ε), unbiased
    under a share ε of flipped labels."""
    chosen, rejected = _ratios(x)
    z, eps = p.beta * (chosen - rejected), p.label_smoothing
    return _dpo_rewards(x, p, (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps))


def bco_pair_loss(x: PairLogps, p) -> PairLosses:
    """BCO on pairs (Jung et al. 2024), as TRL 1.16 has it (no running reward shift): -log σ(βr_c) - log σ(-βr_r)."""
    chosen, rejected = _ratios(x)
    return _dpo_rewards(x, p, -F.logsigmoid(p.beta * chosen) - F.logsigmoid(-p.beta * rejected))


def sppo_hard_loss(x: PairLogps, p) -> PairLosses:
    """SPPO (Wu et al. 2024) with hard win probabilities 1/0: (r_c - 1/(2β))² + (r_r + 1/(2β))²."""
    chosen, rejected = _ratios(x)
    return _dpo_rewards(x, p, (chosen - 0.5 / p.beta) ** 2 + (rejected + 0.5 / p.beta) ** 2)


def aot_loss(x: PairLogps, p) -> PairLosses:
    """AOT (Melnyk et al. 2024), paired: cDPO's mixture on sorted(log π(c) - log π(r)) minus
    sorted(the reference's), sorted over the micro-batch, so a pair's loss depends on its batch."""
    policy, _ = torch.sort(x.chosen - x.rejected, dim=0)
    ref, _ = torch.sort(x.ref_chosen - x.ref_rejected, dim=0)
    return _dpo_rewards(x, p, _smoothed(p.beta * (policy - ref), p.label_smoothing))


def aot_unpaired_loss(x: PairLogps, p) -> PairLosses:
    """AOT, unpaired: cDPO's mixture on sorted(r_c) - sorted(r_r) over the micro-batch."""
    chosen, rejected = _ratios(x)
    delta = torch.sort(chosen, dim=0)[0] - torch.sort(rejected, dim=0)[0]
    return _dpo_rewards(x, p, _smoothed(p.beta * delta, p.label_smoothing))


def apo_zero_loss(x: PairLogps, p) -> PairLosses:
    """APO-zero (D'Oosterlinck et al. 2024, Eq. 7): 1 - σ(βr_c) + σ(βr_r), for chosen answers better
    than the model's own."""
    chosen, rejected = _ratios(x)
    return _dpo_rewards(x, p, 1.0 - torch.sigmoid(p.beta * chosen) + torch.sigmoid(p.beta * rejected))


def apo_down_loss(x: PairLogps, p) -> PairLosses:
    """APO-down (Eq. 8): σ(βr_c) + 1 - σ(βΔ), for chosen answers worse than the model's own."""
    chosen, rejected = _ratios(x)
    return _dpo_rewards(x, p, torch.sigmoid(p.beta * chosen) + 1.0 - torch.sigmoid(p.beta * (chosen - rejected)))


def discopop_loss(x: PairLogps, p) -> PairLosses:
    """DiscoPOP (Chris Lu et al. 2024, Eq. 5): with z = βΔ and m = σ(z/τ),
    (1 - m)·(-log σ(z)) + m·exp(-z); τ is `discopop_tau`."""
    chosen, rejected = _ratios(x)
    z = p.beta * (chosen - rejected)
    mix = torch.sigmoid(z / p.discopop_tau)
    return _dpo_rewards(x, p, -F.logsigmoid(z) * (1.0 - mix) + torch.exp(-z) * mix)


def sigmoid_norm_loss(x: PairLogps, p) -> PairLosses:
    """DPO on per-token log-ratios: -log σ(β(r_c/|c| - r_r/|r|))."""
    chosen, rejected = _ratios(x)
    nc, nr = _counts(x, "sigmoid_norm")
    return _dpo_rewards(x, p, -F.logsigmoid(p.beta * (chosen / nc - rejected / nr)))


def orpo_loss(x: PairLogps, p) -> PairLosses:
    """ORPO (module docstring): per pair, the batch's chosen-answer NLL plus -β log σ(log odds)."""
    nc, nr = _counts(x, "orpo")
    pairs, log_odds = orpo_losses(x.chosen, x.rejected, nc, nr, p.beta)
    nll = orpo_nll(x.chosen, x.chosen_tokens).expand_as(pairs.losses)
    return PairLosses(
        nll + pairs.losses,
        pairs.chosen_rewards,
        pairs.rejected_rewards,
        {"nll": nll.detach(), "log_odds": log_odds.detach()},
    )


def simpo_loss(x: PairLogps, p) -> PairLosses:
    """SimPO (Meng et al. 2024), reference-free: with the mean answer-token log-probs a_c, a_r,
    z = β(a_c - a_r) - γ and cDPO's mixture -(1 - ε) log σ(z) - ε log σ(-z); plus `cpo_alpha` times
    the chosen answers' NLL (CPO-SimPO; TRL's CPOTrainer with loss_type 'simpo'). Rewards β·a."""
    nc, nr = _counts(x, "simpo")
    mean_c, mean_r = x.chosen / nc, x.rejected / nr
    losses = _smoothed(p.beta * (mean_c - mean_r) - p.simpo_gamma, p.label_smoothing)
    extra = None
    if p.cpo_alpha:
        nll = orpo_nll(x.chosen, x.chosen_tokens).expand_as(losses)
        losses, extra = losses + p.cpo_alpha * nll, {"nll": nll.detach()}
    return PairLosses(losses, p.beta * mean_c.detach(), p.beta * mean_r.detach(), extra)


def _no_problems(section: Any, key: str) -> list[str]:
    return []


def _exo_problems(section: Any, key: str) -> list[str]:
    if section.label_smoothing == 0:
        return [f"{key}.label_smoothing: the exo_pair loss needs it > 0 (EXO suggests 1e-3)"]
    return []


class LossSpec(NamedTuple):
    """A registered pair loss: its function, whether it reads a reference, the `dpo` options
    (besides beta) it reads (any other option set away from its default is a config error), and
    its own checks of the `dpo:` section (`problems(section, key)`, one line each)."""

    fn: Callable[[PairLogps, Any], PairLosses]
    reference_free: bool = False
    options: tuple[str, ...] = ()
    problems: Callable[[Any, str], list[str]] = _no_problems


SMOOTHING = ("label_smoothing",)
LOSSES: dict[str, LossSpec] = {
    "sigmoid": LossSpec(sigmoid_loss, options=SMOOTHING),
    "ipo": LossSpec(ipo_loss),
    "hinge": LossSpec(hinge_loss),
    "robust": LossSpec(robust_loss, options=SMOOTHING),
    "exo_pair": LossSpec(exo_pair_loss, options=SMOOTHING, problems=_exo_problems),
    "nca_pair": LossSpec(nca_pair_loss),
    "bco_pair": LossSpec(bco_pair_loss),
    "sppo_hard": LossSpec(sppo_hard_loss),
    "aot": LossSpec(aot_loss, options=SMOOTHING),
    "aot_unpaired": LossSpec(aot_unpaired_loss, options=SMOOTHING),
    "apo_zero": LossSpec(apo_zero_loss),
    "apo_down": LossSpec(apo_down_loss),
    "discopop": LossSpec(discopop_loss, options=("discopop_tau",)),
    "sigmoid_norm": LossSpec(sigmoid_norm_loss),
    "orpo": LossSpec(orpo_loss, reference_free=True),
    "simpo": LossSpec(simpo_loss, reference_free=True, options=(*SMOOTHING, "simpo_gamma", "cpo_alpha")),
}
"""`dpo.loss_type` -> its LossSpec: TRL 1.16's DPOConfig.loss_type values but `sft` (the SFT
stage's job), plus ORPO and SimPO (TRL's ORPOTrainer and CPOTrainer)."""
LOSS_TYPES = tuple(LOSSES)
REFERENCE_FREE = tuple(name for name, spec in LOSSES.items() if spec.reference_free)


class _Params(NamedTuple):
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0


def dpo_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: Optional[torch.Tensor] = None,
    rejected_tokens: Optional[torch.Tensor] = None,
    **options: float,
) -> PairLosses:
    """Per-pair losses of a reference-based `loss_type` from summed answer log-probs (the registry's
    function; `options`: discopop_tau). IPO and sigmoid_norm need the answer token counts.

    Raises:
        ValueError: unknown or reference-free loss type; a length-normalised loss without token counts.
    """
    spec = LOSSES.get(loss_type)
    if spec is None or spec.reference_free:
        based = ", ".join(repr(n) for n in LOSS_TYPES if n not in REFERENCE_FREE)
        raise ValueError(f"dpo_losses: loss_type {loss_type!r} is not one of {based} (orpo, simpo: LOSSES)")
    x = PairLogps(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)
    return spec.fn(x, _Params(beta, label_smoothing, **options))


# --------------------------------------------------------------------------------------------
# A batch's answer log-probs and its losses (the stage's step and evaluation call these)
# --------------------------------------------------------------------------------------------


def sequence_logps(model, batch: dict, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
    """([2B] summed answer log-probs, [2B] answer token counts) of an AnswerPairCollator or
    PackedPairCollator batch (data_formats.collate). The LM head runs at answer positions only
    where that is exact (`pipeline.engine.supervised_head`), else over the full logits."""
    autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
    head = head_split(model, accelerator)
    with autocast:
        if head is not None:
            per_token, mask = labelled_token_logps(model, model_inputs(batch, model), head, batch["labels"])
        else:
            per_token, mask = token_logps(model(**model_inputs(batch, model), use_cache=False).logits, batch["labels"])
    if "sample_index" in batch:
        return packed_sums(per_token, mask, batch["sample_index"], int(batch["sample_index"].max()) + 1)
    return row_sums(per_token, mask)


def pair_losses(
    cfg, sums: torch.Tensor, counts: torch.Tensor, ref: Optional[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, {figure: [B] values}) of one batch from its [2B] policy sums and counts and
    its [2B] reference sums (None for a reference-free loss); `cfg` is the stage's `dpo` section
    (loss_type picks the LOSSES entry, which reads beta and its own options)."""
    half = sums.shape[0] // 2
    x = PairLogps(
        sums[:half],
        sums[half:],
        *(ref[:half], ref[half:]) if ref is not None else (None, None),
        counts[:half],
        counts[half:],
    )
    pairs = LOSSES[cfg.loss_type].fn(x, cfg)
    chosen, rejected = pairs.chosen_rewards, pairs.rejected_rewards
    figures = {
        "loss": pairs.losses.detach(),
        "accuracy": (chosen > rejected).float(),
        "margin": chosen - rejected,
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        **(pairs.extra or {}),
    }
    return pairs.losses.mean(), figures
