"""Unpaired preference math (the KTO stage, stages/kto.py): pure functions on the summed answer
log-probs of samples labelled desirable or undesirable, checked against TRL 1.16's
KTOTrainer._compute_loss in tests/test_kto.py. Each `kto.loss_type` is one function in `LOSSES`.

With r = log π(y|x) - log π_ref(y|x) per sample (sums over answer tokens, as DPO's) and z_ref the
KL estimate below:
- `kto` (Ethayarajh et al. 2024, Eq. 7): desirable λ_D·(1 - σ(β(r - z_ref))), undesirable
  λ_U·(1 - σ(β(z_ref - r))), λ the `desirable_weight` / `undesirable_weight`.
- `apo_zero_unpaired` (D'Oosterlinck et al. 2024, Eq. 7 unpaired): desirable λ_D·(1 - σ(βr)),
  undesirable λ_U·σ(βr); no KL estimate.
The batch loss is the mean over all samples of the micro-batch (TRL's nanmean over both kinds).

z_ref, as TRL estimates it: the mean over the micro-batch of log π(y'|x) - log π_ref(y'|x) on
mismatched pairs (each prompt with the previous sample's answer, data_formats.unpaired
.kl_partners), without gradient, averaged over ranks, then clamped at 0. TRL builds those pairs
once in data order and so needs sequential sampling; Relay builds them from the micro-batch it
draws, which is TRL's pairing whenever the order is the same and the rotation pairs no prompt with
an answer to its own question (the other side of its pair, or the same prompt in another record);
where it would, Relay rotates further or borrows an answer from the rest of the split.

Implicit rewards (logged): β·r, averaged over the desirable (rewards_chosen) and the undesirable
(rewards_rejected) samples, as TRL logs rewards/chosen and rewards/rejected.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from pipeline.engine.steps import all_reduce_sum


def kto_loss(ratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, p) -> torch.Tensor:
    """[N] KTO losses (module docstring) from [N] log-ratios, [N] bool labels and the scalar z_ref."""
    good = p.desirable_weight * (1.0 - torch.sigmoid(p.beta * (ratios - kl)))
    bad = p.undesirable_weight * (1.0 - torch.sigmoid(p.beta * (kl - ratios)))
    return torch.where(desirable, good, bad)


def apo_zero_unpaired_loss(ratios: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, p) -> torch.Tensor:
    """[N] unpaired APO-zero losses (module docstring); `kl` is not read."""
    good = p.desirable_weight * (1.0 - torch.sigmoid(p.beta * ratios))
    bad = p.undesirable_weight * torch.sigmoid(p.beta * ratios)
    return torch.where(desirable, good, bad)


class UnpairedSpec(NamedTuple):
    """A registered unpaired loss: its function and whether it reads the KL estimate (which costs a
    policy and a reference forward on the mismatched pairs)."""

    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
    needs_kl: bool


LOSSES: dict[str, UnpairedSpec] = {
    "kto": UnpairedSpec(kto_loss, needs_kl=True),
    "apo_zero_unpaired": UnpairedSpec(apo_zero_unpaired_loss, needs_kl=False),
}
"""`kto.loss_type` -> its UnpairedSpec: TRL 1.16's KTOConfig.loss_type values."""
LOSS_TYPES = tuple(LOSSES)


def kl_estimate(policy: torch.Tensor, reference: torch.Tensor, accelerator=None) -> torch.Tensor:
    """z_ref (module docstring): the detached mean of `policy - reference` over this micro-batch's
    mismatched pairs, averaged over ranks, clamped at 0."""
    local = (policy - reference).detach().mean()
    ranks = accelerator.num_processes if accelerator is not None else 1
    mean = all_reduce_sum(local.reshape(1).cpu(), accelerator)[0] / ranks if ranks > 1 else local.cpu()
    return mean.to(policy.device).clamp(min=0)


def unpaired_losses(
    cfg, sums: torch.Tensor, ref: torch.Tensor, labels: torch.Tensor, kl: Optional[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(scalar loss: the sample mean, {figure: scalar sum}) of one micro-batch from its [N] policy
    and reference sums, [N] labels (1 desirable) and z_ref (None: 0, for a loss without it). The
    figures are sums with their counts, so that micro-batches and ranks add up: loss, samples,
    chosen_rewards, chosen, rejected_rewards, rejected; `cfg` is the stage's `kto` section."""
    desirable = labels.bool()
    ratios = sums - ref
    kl = torch.zeros((), dtype=sums.dtype, device=sums.device) if kl is None else kl
    losses = LOSSES[cfg.loss_type].fn(ratios, desirable, kl, cfg)
    rewards = cfg.beta * ratios.detach()
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    figures = {
        "loss": losses.detach().sum(),
        "samples": torch.tensor(float(len(losses))),
        "chosen_rewards": torch.where(desirable, rewards, zero).sum(),
        "chosen": desirable.sum().float(),
        "rejected_rewards": torch.where(desirable, zero, rewards).sum(),
        "rejected": (~desirable).sum().float(),
    }
    return losses.mean(), figures


def figure_means(sums: dict[str, float]) -> dict[str, float]:
    """loss, rewards_chosen, rewards_rejected, margin from `unpaired_losses`'s summed figures (NaN
    where a kind had no sample)."""

    def mean(key: str, count: str) -> float:
        return sums[key] / sums[count] if sums[count] else float("nan")

    chosen, rejected = mean("chosen_rewards", "chosen"), mean("rejected_rewards", "rejected")
    return {
        "loss": mean("loss", "samples"),
        "rewards_chosen": chosen,
        "rewards_rejected": rejected,
        "margin": chosen - rejected,
    }


def weight_advice(
    desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float
) -> Optional[str]:
    """The KTO paper's advice (Eq. 8: λ_D·n_D / (λ_U·n_U) in [1, 4/3]) when the weights fall outside
    it, as TRL warns; None when they are within it or the data is balanced."""
    if desirable == undesirable or not desirable or not undesirable:
        return None
    ratio = desirable_weight * desirable / (undesirable_weight * undesirable)
    if 1.0 <= ratio <= 4.0 / 3.0:
        return None
    low, high = undesirable_weight * undesirable / desirable, undesirable_weight * undesirable / desirable * 4.0 / 3.0
    return (
        f"kto: {desirable} desirable and {undesirable} undesirable samples with weights "
        f"{desirable_weight}/{undesirable_weight}: "
        "the KTO paper advises desirable_weight·n_D / (undesirable_weight·n_U) "
        f"in [1, 4/3], e.g. desirable_weight in [{low:.2f}, {high:.2f}]"
    )
