"""GRPO's math and update (the algorithm; the stage is stages/grpo.py): group-relative advantages,
the clipped ratio loss with a k3 KL term and token-level normalisation, scoring a rollout, and
`grpo.num_iterations` optimizer steps over one generation batch.

No critic: each prompt is sampled `num_generations` (G) times and a completion's advantage is its
reward against its group's, A = (r - mean_group) / (std_group + eps) (or without the std, as
Dr. GRPO argues). The rollout, generation, log-probs and the clipped surrogate are PPO's
(pipeline/algorithms/rollout.py, rl.py).

Agreement with TRL 1.16 (trl/trainer/grpo_trainer.py, `_generate_and_score_completions` and
`_compute_loss`) is pinned in tests/test_grpo.py. Where Relay chooses:
- `loss_type: dapo` (the default, TRL's default too): the sum of per-token losses over every
  completion token of the optimizer step's batch (every micro-batch, every rank) divided by that
  number of tokens, so a long completion weighs as many tokens as it has and the loss does not
  depend on how the batch is split into micro-batches. TRL's `bnpo` divides by the tokens of each
  micro-batch instead (the same when there is one micro-batch). `loss_type: grpo` is the
  original per-sequence mean (mean over completions of each one's token mean), which gives
  every token of a short completion more weight.
- One optimizer step covers the whole generation batch (TRL can split it over
  `steps_per_generation` steps); `num_iterations` repeats that step with the rollout's log-probs
  as the old policy.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch

from pipeline.algorithms import rl
from pipeline.algorithms.rollout import ActorCritic, Rollout, chunks
from pipeline.engine.steps import check_finite, clip_gradients, micro_step

LOSS_TYPES = ("dapo", "grpo")
ADVANTAGE_EPS = 1e-4
"""TRL's epsilon under the group std (grpo_trainer.py: `advantages / (std_rewards + 1e-4)`)."""


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """Each reward minus the mean of its group, divided by the group's std + eps when `scale`
    ([N] -> [N]; groups are consecutive runs of `group_size`). The std is Bessel-corrected, as
    TRL's `nanstd`; a group whose rewards are all equal gets advantage 0 (nothing to learn).

    Raises:
        ValueError: N is not a multiple of group_size, or group_size < 2.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: {rewards.numel()} rewards do not form groups of {group_size} (>= 2)")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(1, keepdim=True)
    if scale:
        centred = centred / (grouped.std(1, unbiased=True, keepdim=True) + eps)
    return centred.view(-1).to(rewards.dtype)


@dataclass
class GRPOLossOut:
    loss: torch.Tensor
    """The micro-batch's share of the step's loss (see grpo_loss)."""
    clipfrac: torch.Tensor
    """Tokens whose clipped term won, over the micro-batch's tokens."""
    kl: Optional[torch.Tensor]
    """Mean k3 KL(policy || reference) per token of the micro-batch (None when beta is 0)."""


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, epsilon: float,
              epsilon_high: Optional[float] = None, beta: float = 0.0, ref_logp: Optional[torch.Tensor] = None,
              loss_type: str = "dapo", num_tokens: Optional[float] = None, num_sequences: Optional[int] = None,
              is_weight: Optional[torch.Tensor] = None) -> GRPOLossOut:
    """The GRPO loss of one micro-batch ([B, T] log-probs and mask, [B] advantages).

    Per token: max(-A r, -A clip(r, 1 - epsilon, 1 + epsilon_high)) + beta * k3(policy, reference),
    k3 = exp(ref - logp) - (ref - logp) - 1.
    - 'dapo': sum over the micro-batch's tokens / `num_tokens`, the tokens of the whole optimizer
      step (default: this micro-batch's own, which is TRL's 'bnpo'), so summing the micro-batches'
      losses gives the step's token mean.
    - 'grpo': sum over the micro-batch's completions of each one's token mean / `num_sequences`
      (default: this micro-batch's completions).
    `is_weight` ([B, T], no gradient): the train-inference mismatch correction
    (pipeline/algorithms/mismatch.py) multiplying each token's clipped term, before the KL is added.

    Raises:
        ValueError: unknown loss_type, beta > 0 without ref_logp, or a completion without tokens.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} is not one of {LOSS_TYPES}")
    mask = mask.to(logp.dtype)
    per_token, was_clipped = rl.clipped_surrogate(logp, old_logp, advantages.to(logp.dtype).unsqueeze(1), epsilon, epsilon_high)
    if is_weight is not None:
        per_token = per_token * is_weight.to(per_token.dtype)
    kl = None
    if beta:
        if ref_logp is None:
            raise ValueError("grpo_loss: beta > 0 needs the reference log-probs")
        kl = rl.kl_per_token(logp, ref_logp, "k3")
        per_token = per_token + beta * kl
    lengths = mask.sum(1)
    if (lengths == 0).any():
        raise ValueError("grpo_loss: a completion has no tokens")
    if loss_type == "dapo":
        loss = (per_token * mask).sum() / (float(num_tokens) if num_tokens is not None else lengths.sum())
    else:
        loss = ((per_token * mask).sum(1) / lengths).sum() / (num_sequences if num_sequences is not None else logp.shape[0])
    clipfrac = rl.masked_mean(was_clipped.to(mask.dtype), mask).detach()
    return GRPOLossOut(loss, clipfrac, None if kl is None else rl.masked_mean(kl, mask).detach())


# ------------------------------------------------------------------------------------------
# Scoring and the update (models)
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def score_completions(model: ActorCritic, rollout: Rollout, *, micro: int, temperature: float, autocast, old: bool,
                  reference: bool) -> dict[str, torch.Tensor]:
    """The rollout's log-probs under the sampling policy ('old', when `old`) and the reference
    ('ref', when `reference`), in micro-batches of the size the update uses, so the update's first
    forward reproduces 'old' exactly. Nothing is run for what is not asked (beta 0 and one
    iteration: no forward at all)."""
    out = defaultdict(list)
    if not (old or reference):
        return {}
    device = next(model.parameters()).device
    P = rollout.prompt_width
    for rows in chunks(rollout.input_ids.shape[0], micro):
        ids, mask = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
        with autocast():
            if old:
                logits, _ = model(ids, mask, P, critic=False)
                out["old"].append(rl.logprobs_from_logits(logits.float() / temperature, ids[:, P:]).cpu())
            if reference:
                out["ref"].append(model.reference_logprobs(ids, mask, P, temperature).cpu())
    return {k: torch.cat(v) for k, v in out.items()}


def grpo_update(model, optimizer, rollout: Rollout, advantages: torch.Tensor, scored: dict, accelerator, cfg, step: int) -> dict[str, float]:
    """`grpo.num_iterations` optimizer steps over the generation batch, each accumulated over
    `train.grad_accum` micro-batches in rollout order. Old log-probs are the rollout's ('old', or
    with one iteration the first forward's own, detached: the same numbers, one forward fewer).

    Returns the mean loss, clipfrac, kl (k3 per token, when beta > 0), grad_norm and
    `ratio_dev_first` (max |ratio - 1| of the first micro-batch before any update; 0 when 'old'
    is given, as it must be).

    Raises:
        NonFiniteError: a non-finite loss or gradient (before the optimizer steps).
    """
    g, temperature, device = cfg.grpo, cfg.generation.temperature, accelerator.device
    B, accum = rollout.input_ids.shape[0], cfg.train.grad_accum
    micro, P = B // accum, rollout.prompt_width
    mask_all = rollout.response_mask.float()
    totals = torch.tensor([mask_all.sum(), float(B)], device=device)
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(totals, reduction="sum")
    # accelerator.backward divides each micro-batch's loss by accum; these losses are already
    # shares of the step's (and the ranks' mean gradient is wanted), so scale back up.
    scale = accum * accelerator.num_processes
    num_tokens, num_sequences = float(totals[0]), int(totals[1])
    stats: dict[str, list[float]] = defaultdict(list)
    for _ in range(g.num_iterations):
        total = 0.0
        for k in range(accum):
            rows = slice(k * micro, (k + 1) * micro)
            ids, attn = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
            mask = rollout.response_mask[rows].to(device)
            with micro_step(accelerator, model, k, accum):
                with accelerator.autocast():
                    logits, _ = model(ids, attn, P, critic=False)
                logp = rl.logprobs_from_logits(logits.float() / temperature, ids[:, P:])
                old = scored["old"][rows].to(device) if "old" in scored else logp.detach()
                ref = scored["ref"][rows].to(device) if "ref" in scored else None
                weight = scored["is_weight"][rows].to(device) if "is_weight" in scored else None  # mismatch correction
                out = grpo_loss(logp, old, advantages[rows].to(device), mask, epsilon=g.epsilon, epsilon_high=g.epsilon_high,
                                beta=g.beta, ref_logp=ref, loss_type=g.loss_type, num_tokens=num_tokens, num_sequences=num_sequences,
                                is_weight=weight)
                accelerator.backward(out.loss * scale)
            if "ratio_dev_first" not in stats:
                stats["ratio_dev_first"].append(float(((logp.detach() - old).exp() - 1).abs().mul(mask).max()))
            total += float(out.loss.detach())
            stats["clipfrac"].append(float(out.clipfrac))
            if out.kl is not None:
                stats["kl"].append(float(out.kl))
        grad_norm = clip_gradients(model, accelerator, cfg.train.max_grad_norm)
        check_finite(total, model, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if accelerator.num_processes > 1:  # each rank holds its share of the step's loss
            total = float(accelerator.reduce(torch.tensor(total, device=device), reduction="sum"))
        stats["loss"].append(total)
        stats["grad_norm"].append(grad_norm)
    return {k: sum(v) / len(v) for k, v in stats.items()}
