"""Preference optimisation math (the DPO stage, stages/dpo.py): small pure functions on sequence
log-probabilities, with golden tests against TRL 1.16 in tests/test_dpo.py, and a batch's answer
log-probs (`sequence_logps`) and losses with their logged figures (`pair_losses`).

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

Implicit rewards (logged): β·(log π - log π_ref) per side for sigmoid/ipo (TRL's rewards/chosen,
rewards/rejected); for orpo β·(mean answer log-prob), as TRL's ORPOTrainer logs them.
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from data_formats.collate import IGNORE_INDEX
from pipeline.engine.steps import model_inputs
from pipeline.engine.supervised_head import head_split, labelled_token_logps

LOSS_TYPES = ("sigmoid", "ipo", "orpo")
REFERENCE_FREE = ("orpo",)


class PairLosses(NamedTuple):
    """Per pair ([B]): the loss, and the implicit rewards of the chosen and rejected answers."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


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


def packed_answer_logps(logits: torch.Tensor, labels: torch.Tensor, sample_index: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([count] summed log-probs, [count] token counts) per sample of packed rows, where
    `sample_index` [R, T] names the sample each position belongs to (-1: padding)."""
    return packed_sums(*token_logps(logits, labels), sample_index, count)


def packed_sums(per_token: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`packed_answer_logps` from `token_logps`'s [R, T-1] pair."""
    owner = sample_index[:, 1:]
    keep = mask & (owner >= 0)
    sums = torch.zeros(count, dtype=per_token.dtype, device=per_token.device).index_add(0, owner[keep], per_token[keep])
    counts = torch.zeros(count, dtype=torch.long, device=per_token.device).index_add(0, owner[keep], torch.ones_like(owner[keep]))
    return sums, counts


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
               chosen_tokens: Optional[torch.Tensor] = None, rejected_tokens: Optional[torch.Tensor] = None) -> PairLosses:
    """Per-pair DPO (`sigmoid`, with label smoothing) or IPO losses from summed answer log-probs
    (module docstring). IPO needs the answer token counts.

    Raises:
        ValueError: unknown or reference-free loss type; IPO without token counts.
    """
    chosen_ratio, rejected_ratio = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    if loss_type == "sigmoid":
        logits = beta * (chosen_ratio - rejected_ratio)
        losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    elif loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_losses: the ipo loss needs the answers' token counts")
        delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (delta - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"dpo_losses: loss_type {loss_type!r} is not one of 'sigmoid', 'ipo' (orpo: orpo_losses)")
    return PairLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (Mächler 2012)."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_log_odds(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor) -> torch.Tensor:
    """[B] log odds ratio of the chosen over the rejected answer from mean answer-token log-probs."""
    return (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))


def orpo_losses(chosen_sum: torch.Tensor, rejected_sum: torch.Tensor, chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor,
                beta: float) -> tuple[PairLosses, torch.Tensor]:
    """(per-pair odds-ratio terms -β log σ(log odds) with the rewards, [B] log odds) from summed
    answer log-probs and answer token counts. The ORPO loss adds `orpo_nll` to their mean."""
    chosen_mean = chosen_sum / chosen_tokens.clamp(min=1)
    rejected_mean = rejected_sum / rejected_tokens.clamp(min=1)
    log_odds = orpo_log_odds(chosen_mean, rejected_mean)
    return PairLosses(-beta * F.logsigmoid(log_odds), beta * chosen_mean.detach(), beta * rejected_mean.detach()), log_odds


def orpo_nll(chosen_sum: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """ORPO's SFT term: the token-mean NLL over the chosen answers of a batch."""
    return -chosen_sum.sum() / chosen_tokens.sum().clamp(min=1)


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
            per_token, mask = labelled_token_logps(model, model_inputs(batch), head, batch["labels"])
        else:
            per_token, mask = token_logps(model(**model_inputs(batch), use_cache=False).logits, batch["labels"])
    if "sample_index" in batch:
        return packed_sums(per_token, mask, batch["sample_index"], int(batch["sample_index"].max()) + 1)
    return row_sums(per_token, mask)


def pair_losses(cfg, sums: torch.Tensor, counts: torch.Tensor, ref: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss, {figure: [B] values}) of one batch from its [2B] policy sums and counts and
    its [2B] reference sums (None for ORPO); `cfg` is the stage's `dpo` section (loss_type, beta,
    label_smoothing)."""
    half = sums.shape[0] // 2
    pc, pr, nc, nr = sums[:half], sums[half:], counts[:half], counts[half:]
    extra: dict[str, torch.Tensor] = {}
    if cfg.loss_type == "orpo":
        pairs, log_odds = orpo_losses(pc, pr, nc, nr, cfg.beta)
        nll = orpo_nll(pc, nc)
        loss = nll + pairs.losses.mean()
        extra = {"nll": nll.detach().expand(half), "log_odds": log_odds.detach()}
    else:
        pairs = dpo_losses(pc, pr, ref[:half], ref[half:], cfg.beta, cfg.loss_type, cfg.label_smoothing, nc, nr)
        loss = pairs.losses.mean()
    chosen, rejected = pairs.chosen_rewards, pairs.rejected_rewards
    figures = {"loss": pairs.losses.detach() + (extra["nll"] if "nll" in extra else 0.0), "accuracy": (chosen > rejected).float(),
               "margin": chosen - rejected, "rewards_chosen": chosen, "rewards_rejected": rejected, **extra}
    return loss, figures
