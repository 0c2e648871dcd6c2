"""PPO's algorithm (the stage is stages/ppo.py): scoring a rollout (`score_rollout`), turning it
into shaped rewards, advantages and returns (`make_experience` -> `Experience`), and `ppo.epochs`
passes of clipped policy and value updates over mini-batches (`ppo_update`), each mini-batch one
optimizer step accumulated over `train.grad_accum` micro-batches
(`pipeline.engine.steps.micro_step`; one micro-batch's forward and backward is
`actor_critic_backward`). Sampling, `Rollout` and the actor-critic module are the RL stages'
shared pipeline/rl/rollout.py.

Over several ranks everything is global, so N ranks of B prompts update exactly as one process of
N x B (tests/test_distributed_stages.py): the reward normaliser's statistics take every rank's raw
scores (`shape_scores`), advantages are whitened over every rank's response tokens
(`rl.masked_whiten` with an all-reduce), and each mini-batch's loss is token-normalised over the
whole mini-batch, every rank's micro-batches together (`ppo_update`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pipeline.algorithms import rl
from pipeline.algorithms.mismatch import correction_weights
from pipeline.algorithms.rl import policy_loss, value_loss
from pipeline.engine.fsdp import runs_unwrapped
from pipeline.engine.steps import all_reduce_sum, optimizer_step, pooled_means, rank_mean
from pipeline.rl.rollout import ActorCritic, PolicyOut, Rollout, chunks

REWARD_NORMS = ("none", "running", "stored")
"""ppo.reward_norm: no normalisation, running statistics, or the RM's stored `reward_stats`."""

RewardFn = Callable[[list[str], list[list[int]]], torch.Tensor]
"""reward_fn(prompt_texts, response_ids) -> [B] rewards, in place of the reward model's score."""


@dataclass
class Experience:
    """A scored rollout with everything the PPO update needs ([B, R] tensors unless noted)."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    kl: torch.Tensor
    raw_scores: torch.Tensor  # [B]
    scores: torch.Tensor  # [B], after normalisation, clipping and the EOS penalty
    entropy: torch.Tensor  # [B, R] entropy of the rollout policy
    held_logits: Optional[PolicyOut] = None
    """The scoring pass's policy log-probs (`PolicyOut`) still attached to their graph, when the
    update's first micro-batch is the whole rollout in order (`holds_first_forward`): that
    micro-batch reuses them instead of running the same forward again. Released once used."""
    held_values: Optional[torch.Tensor] = None
    """The critic's values from the same scoring pass, attached to their graph likewise (the first
    micro-batch's value loss reuses them). Released once used."""
    is_weight: Optional[torch.Tensor] = None
    """The train-inference mismatch correction's per-token weight ([B, R], generation.correction),
    when the engine reported its log-probs (`Rollout.engine_logp`, vLLM); None: unweighted."""


def holds_first_forward(rows: int, micro: int, mini: int, separate: bool) -> bool:
    """Whether the update's first micro-batch is the whole rollout in order, with the policy's own
    forward and backward (`separate`: one process), so the scoring pass can hand it its policy
    forward: one micro-batch (`micro` >= `rows`) in the first mini-batch (`mini` >= `rows`)."""
    return separate and micro >= rows and mini >= rows


@torch.no_grad()
def score_rollout(
    model: ActorCritic,
    rollout: Rollout,
    *,
    micro: int,
    temperature: float,
    autocast,
    hold: bool = False,
    values: bool = True,
) -> dict[str, torch.Tensor]:
    """Rollout log-probs, reference log-probs, values, entropy and RM scores, in micro-batches of
    the size the update uses (so the first update reproduces the rollout log-probs exactly).

    `values=False` (an evaluation: reward and KL only) skips the critic's forward and leaves
    'values' out; `hold` needs them.

    `hold` (see `holds_first_forward`): the policy's and the critic's forwards run with gradients
    on, and their log-probs (`PolicyOut`) and values come back as 'held' and 'held_values', attached to their
    graphs, for the update's first micro-batch: one policy and one critic forward fewer a step
    (the critic's hold comes with the shared-prefix prefill). The numbers are those of the
    forwards the update would run, so its ratio is still exactly 1. Both graphs stay alive from
    here to that micro-batch's backward: the joint pass's memory for the first micro-batch."""
    device = next(model.parameters()).device
    out = defaultdict(list)
    P = rollout.prompt_width
    held = held_values = None
    for rows in chunks(rollout.input_ids.shape[0], micro):
        ids, mask = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
        with autocast():
            if hold:
                with torch.enable_grad():
                    held, held_values = model(ids, mask, P, temperature=temperature, entropy=True)
                policy, value = held, held_values.detach()
            else:
                policy, value = model(ids, mask, P, critic=values, temperature=temperature, entropy=True)
            out["old"].append(policy.logp.detach().cpu())
            out["entropy"].append(policy.entropy.cpu())
            if value is not None:
                out["values"].append(value.float().cpu())
            out["ref"].append(model.reference_logprobs(ids, mask, P, temperature).cpu())
            out["rm"].append(model.reward_scores(ids, mask, P).float().cpu())
    scored = {k: torch.cat(v) for k, v in out.items()}
    if held is not None:
        scored["held"], scored["held_values"] = held, held_values
    return scored


def shape_scores(
    raw: torch.Tensor, finished: torch.Tensor, normaliser: rl.RunningMoments, cfg, gathered: torch.Tensor
) -> torch.Tensor:
    """Normalise (updating running statistics with every rank's raw scores, `gathered`, so every
    rank holds the same statistics and they equal one process's over the same prompts), clip,
    then subtract the missing-EOS penalty."""
    if cfg.ppo.reward_norm == "running":
        normaliser.update(gathered)
    scores = normaliser.normalise(raw) if cfg.ppo.reward_norm != "none" else raw.clone()
    if cfg.ppo.reward_clip:
        scores = scores.clamp(-cfg.ppo.reward_clip, cfg.ppo.reward_clip)
    if cfg.generation.missing_eos_penalty:
        scores = scores - cfg.generation.missing_eos_penalty * (~finished).to(scores.dtype)
    return scores


def make_experience(
    model: ActorCritic,
    rollout: Rollout,
    prompts_text: list[str],
    *,
    cfg,
    kl_coef: float,
    normaliser: rl.RunningMoments,
    reward_fn: Optional[RewardFn],
    accelerator,
    combine: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> Experience:
    """Score a rollout and turn it into advantages and returns (advantages whitened over every
    rank's response tokens; every rank calls this). `combine(score) -> raw`: the stage's sum of the
    reward model's (or reward_fn's) [B] score with its other reward sources, before normalisation."""
    mini = cfg.ppo.mini_batch_size or cfg.train.batch_size
    micro = mini // cfg.train.grad_accum
    hold = holds_first_forward(rollout.input_ids.shape[0], micro, mini, runs_unwrapped(accelerator, model))
    s = score_rollout(
        model, rollout, micro=micro, temperature=cfg.generation.temperature, autocast=accelerator.autocast, hold=hold
    )
    raw = s["rm"] if reward_fn is None else reward_fn(prompts_text, rollout.responses).detach().float().cpu()
    if combine is not None:
        raw = combine(raw)
    gathered = accelerator.gather(raw.to(accelerator.device)).cpu()
    scores = shape_scores(raw, rollout.finished, normaliser, cfg, gathered)
    mask = rollout.response_mask
    # untrained positions (padding, a tool rollout's inserted results): their log-probs are never read
    old, ref = (s[k].masked_fill(mask == 0, 0.0) for k in ("old", "ref"))
    kl = rl.kl_per_token(old, ref, cfg.ppo.kl_estimator) * mask
    rewards = rl.token_rewards(scores, kl, mask, kl_coef)
    advantages, returns = rl.gae_over_turns(rewards, s["values"], mask, cfg.ppo.gamma, cfg.ppo.lam)
    total = lambda t: all_reduce_sum(t, accelerator)  # noqa: E731 (a sum over ranks)
    if cfg.ppo.whiten_advantages and float(total(mask.sum().double().view(1))[0]) > 1:
        advantages = rl.masked_whiten(advantages, mask, all_reduce=total)
    gen = cfg.generation
    is_weight = (
        None
        if rollout.engine_logp is None
        else correction_weights(
            gen.correction_name, old, rollout.engine_logp, mask, gen.correction_cap, gen.correction_floor
        )
    )
    return Experience(
        rollout,
        old,
        ref,
        s["values"] * mask,
        advantages,
        returns,
        kl,
        raw,
        scores,
        s["entropy"],
        held_logits=s.get("held"),
        held_values=s.get("held_values"),
        is_weight=is_weight,
    )


def actor_critic_backward(
    model,
    exp: Experience,
    idx: torch.Tensor,
    accelerator,
    *,
    separate: bool,
    temperature: float,
    cliprange: float,
    cliprange_value: float,
    vf_coef: float,
    step_tokens: Optional[float | torch.Tensor] = None,
    held: Optional[torch.Tensor] = None,
    held_values: Optional[torch.Tensor] = None,
) -> dict[str, float]:
    """Forward and backward of one micro-batch: `policy loss + vf_coef * value loss` (inside
    `micro_step`, so accelerate divides it by the number of micro-batches of the step).

    `step_tokens` (the response tokens of the whole optimizer step, every micro-batch on every
    rank) token-normalises the step: each loss, a token mean over this micro-batch, is weighted by
    its share of the step's tokens, times the micro-batches per step and the ranks (undoing
    accelerate's division and DDP's average), so the gradient is that of sum(token losses) /
    step_tokens. None: the micro-batch's token mean as it is (a mean of micro-batch means).

    `separate` gives the policy and the critic a forward and backward each, so only one model's
    activations are alive at a time (about half the peak memory of the joint pass, the same
    gradients: the two models share no parameters). The joint pass is for wrapped engines (DDP,
    DeepSpeed, FSDP), which expect one forward per backward over the whole module. `held` /
    `held_values`: the scoring pass's policy log-probs (`PolicyOut`) / critic values, still attached to their
    graphs (`Experience`), used in place of that model's forward (`separate` only).

    Returns the micro-batch's statistics (`micro_batch_figures`), on the device.
    """
    device = accelerator.device
    P = exp.rollout.prompt_width
    ids, attn = exp.rollout.input_ids[idx].to(device), exp.rollout.attention_mask[idx].to(device)
    mask, old = exp.rollout.response_mask[idx].to(device), exp.old_logprobs[idx].to(device)
    is_weight = None if exp.is_weight is None else exp.is_weight[idx].to(device)

    def policy_part(policy: PolicyOut):
        logp = policy.logp.masked_fill(mask == 0, 0.0)
        # the caller checked on the host that the micro-batch has response tokens (`ppo_update`)
        return logp, policy_loss(
            logp, old, exp.advantages[idx].to(device), mask, cliprange, weight=is_weight, check=False
        )

    def value_part(values):
        return value_loss(
            values.float(), exp.values[idx].to(device), exp.returns[idx].to(device), mask, cliprange_value, check=False
        )

    weight = _token_weight(mask, step_tokens, accelerator)
    if separate:
        policy = held
        if policy is None:
            with accelerator.autocast():
                policy, _ = model(ids, attn, P, critic=False, temperature=temperature)
        logp, pol = policy_part(policy)
        accelerator.backward(pol.loss * weight)
        del policy
        values = held_values
        if values is None:
            with accelerator.autocast():
                _, values = model(ids, attn, P, policy=False)
        vloss, vclip = value_part(values)
        accelerator.backward(vf_coef * vloss * weight)
    else:
        with accelerator.autocast():
            policy, values = model(ids, attn, P, temperature=temperature)
        logp, pol = policy_part(policy)
        vloss, vclip = value_part(values)
        accelerator.backward((pol.loss + vf_coef * vloss) * weight)
    return micro_batch_figures(pol, vloss, vclip, vf_coef, logp, old, mask)


def _token_weight(mask: torch.Tensor, step_tokens, accelerator) -> float | torch.Tensor:
    """A micro-batch loss's weight when the step is token-normalised: its share of the step's
    tokens, times the micro-batches per step and the ranks (undoing accelerate's division and DDP's
    average); 1 without `step_tokens`. On the device (a float() here would wait for it): the same
    double arithmetic, then fp32 as a Python number would be when multiplying an fp32 loss."""
    if step_tokens is None:
        return 1.0
    device = mask.device
    share = mask.sum().double() / torch.as_tensor(step_tokens, dtype=torch.float64, device=device)
    return (share * accelerator.gradient_accumulation_steps * accelerator.num_processes).float()


MICRO_FIGURES = ("loss", "policy_loss", "value_loss", "clipfrac_policy", "clipfrac_value", "approx_kl", "ratio_dev")
"""The figures of one micro-batch, in the order `ppo_update` keeps them on the device."""
POOLED_FIGURES = MICRO_FIGURES[1:-1]
"""The token means among them, which a step reports over all its response tokens (`pooled_means`)."""


def micro_batch_figures(
    pol, vloss: torch.Tensor, vclip, vf_coef: float, logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One micro-batch's statistics as 0-d float64 tensors on the device, read by the caller once
    per step (`ratio_dev`: max |ratio - 1| over its response tokens)."""
    policy, value = pol.loss.detach().double(), vloss.detach().double()
    return {
        "loss": policy + vf_coef * value,
        "policy_loss": policy,
        "value_loss": value,
        "clipfrac_policy": pol.clipfrac.double(),
        "clipfrac_value": vclip.double(),
        "approx_kl": pol.approx_kl.double(),
        "ratio_dev": ((logp.detach() - old).exp() - 1).abs().mul(mask).max().double(),
    }


def ppo_update(model, optimizer, exp: Experience, accelerator, cfg, step: int) -> dict[str, float]:
    """`ppo.epochs` passes over the rollout in shuffled mini-batches, one optimizer step each.

    Each mini-batch's loss is token-normalised over the whole mini-batch: sum of the token losses
    of every micro-batch on every rank / the mini-batch's response tokens on all ranks, so the
    update does not depend on how the mini-batch is split (1 x 8, 2 x 4, 8 x 1, or over ranks).
    This is TRL's GRPOTrainer `loss_type="dapo"` normalisation (the sum over the accumulated
    global batch's tokens / their count, `num_items_in_batch`, trl/trainer/grpo_trainer.py in TRL
    1.16); TRL's old PPOTrainer and its `bnpo` took a token mean per micro-batch, whose update
    depends on the split when responses differ in length.

    Also reports `ratio_dev_first`: max |ratio - 1| on the first micro-batch before any update
    (0 when the update reproduces the rollout log-probs, as it must).

    Raises:
        NonFiniteError: a non-finite loss or gradient (before the optimizer steps).
    """
    B = exp.old_logprobs.shape[0]
    mini = cfg.ppo.mini_batch_size or cfg.train.batch_size
    accum = cfg.train.grad_accum
    micro = mini // accum
    separate = runs_unwrapped(accelerator, model)
    order_gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step)
    stats: dict[str, list[float]] = defaultdict(list)
    for epoch in range(cfg.ppo.epochs):
        # The first pass keeps rollout order so its micro-batches are exactly those of the rollout.
        order = torch.arange(B) if epoch == 0 else torch.randperm(B, generator=order_gen)
        for start in range(0, B, mini):
            rows = order[start : start + mini]
            tokens = _mini_batch_tokens(exp, rows, micro, accum, accelerator, step)
            # every micro-batch's figures (MICRO_FIGURES) and response tokens stay on the device until
            # the step's one read
            figures: list[torch.Tensor] = []
            counts: list[torch.Tensor] = []

            def micro_batch(k: int, rows=rows, tokens=tokens, figures=figures, counts=counts) -> torch.Tensor:
                idx = rows[k * micro : (k + 1) * micro]
                counts.append(exp.rollout.response_mask[idx].sum())
                micro_stats = actor_critic_backward(
                    model,
                    exp,
                    idx,
                    accelerator,
                    separate=separate,
                    temperature=cfg.generation.temperature,
                    cliprange=cfg.ppo.cliprange,
                    cliprange_value=cfg.ppo.cliprange_value,
                    vf_coef=cfg.ppo.vf_coef,
                    step_tokens=tokens,
                    **_take_held(exp, idx, separate),
                )
                figures.append(torch.stack([micro_stats[name] for name in MICRO_FIGURES]))
                return micro_stats["loss"] / accum

            def step_figures(figures=figures, counts=counts) -> torch.Tensor:
                """[the step's loss, each micro-batch's ratio_dev, the step's POOLED_FIGURES]"""
                table = torch.stack(figures)
                pooled = pooled_means(table[:, 1:-1], torch.stack(counts), accelerator)
                return torch.cat([(table[:, 0] / accum).sum().view(1), table[:, -1], pooled])

            done = optimizer_step(
                model,
                optimizer,
                accelerator,
                accum,
                micro_batch,
                step=step,
                max_grad_norm=cfg.train.max_grad_norm,
                figures=step_figures,
            )
            _read_mini_batch(done, accum, stats)
    return {k: sum(v) / len(v) for k, v in stats.items()}


def _mini_batch_tokens(exp: Experience, rows: torch.Tensor, micro: int, accum: int, accelerator, step: int):
    """The response tokens of the mini-batch `rows` on every rank (a device tensor), each micro-batch's
    counted on the host where the rollout lives.

    Raises:
        ValueError: a micro-batch without a response token (its token mean would divide by 0)."""
    per_micro = torch.stack([exp.rollout.response_mask[rows[k * micro : (k + 1) * micro]].sum() for k in range(accum)])
    if bool((per_micro == 0).any()):
        raise ValueError(f"ppo_update: a micro-batch of step {step} has no response token")
    return all_reduce_sum(per_micro.sum().double().view(1).to(accelerator.device), accelerator)[0]


def _take_held(exp: Experience, idx: torch.Tensor, separate: bool) -> dict:
    """The scoring pass's forwards still attached to their graphs (`Experience.held_logits`,
    `held_values`), for the first micro-batch only, which must be the whole rollout in order; the
    experience lets go of them.

    Raises:
        RuntimeError: held forwards for another micro-batch (they would train on the wrong rows)."""
    held, held_values = exp.held_logits, exp.held_values
    exp.held_logits = exp.held_values = None
    if (held is not None or held_values is not None) and not (
        separate and torch.equal(idx, torch.arange(exp.old_logprobs.shape[0]))
    ):
        raise RuntimeError("ppo_update: held forwards for a first micro-batch that is not the whole rollout")
    return {"held": held, "held_values": held_values}


def _read_mini_batch(done, accum: int, stats: dict) -> None:
    """Add one optimizer step's figures (read from the host once: [the step's loss, each
    micro-batch's ratio_dev, the step's POOLED_FIGURES over all its tokens on every rank]) to
    `stats`, which then averages them over the optimizer steps of the PPO step."""
    read = done.figures.tolist()[1:]
    if not stats["ratio_dev_first"]:
        stats["ratio_dev_first"].append(read[0])
    for key, value in zip(POOLED_FIGURES, read[accum:]):
        stats[key].append(value)
    stats["grad_norm"].append(done.grad_norm)


def step_metrics(exp: Experience, update: dict, accelerator, *, kl_coef: float, gen_frac: float) -> dict[str, float]:
    """The ppo/* scalars of one step: rollout statistics per sequence averaged over ranks (every rank
    holds as many), the entropy over every rank's response tokens (ranks' responses differ in length:
    a mean of their token means would weigh a rank of short responses more), the update's as
    `ppo_update` pooled them."""
    mask = exp.rollout.response_mask
    seq_kl = exp.kl.sum(1)
    local = {
        "ppo/reward_raw": float(exp.raw_scores.mean()),
        "ppo/reward_norm": float(exp.scores.mean()),
        "ppo/kl": float(seq_kl.mean()),
        "entropy_sum": float((exp.entropy * mask).sum()),
        "tokens": float(mask.sum()),
        "ppo/response_length": float(mask.sum(1).float().mean()),
    }
    local.update({f"ppo/{k}": v for k, v in update.items() if k != "grad_norm"})
    out = rank_mean(local, accelerator)
    out["ppo/entropy"] = out.pop("entropy_sum") / max(out.pop("tokens"), 1e-30)
    out.update(
        {
            "ppo/kl_coef": kl_coef,
            "ppo/gen_time_frac": gen_frac,
            "train/grad_norm": update.get("grad_norm", float("nan")),
        }
    )
    return out
