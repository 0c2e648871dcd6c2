"""GRPO's scoring and update (the algorithm; the stage is stages/grpo.py): scoring a rollout and
`grpo.num_iterations` optimizer steps over one generation batch. The pieces live beside it: the
policy losses (`grpo.loss_type`, a registry) in grpo_losses.py, the advantage estimators, reward
aggregations, overlong shaping and the dynamic-sampling filter in advantages.py, the `grpo:`
section and its checks in grpo_config.py.

No critic: each prompt is sampled `num_generations` (G) times and a completion's advantage is its
reward against its group's (or another estimator's). The rollout, generation and log-probs are
PPO's (pipeline/rl/rollout.py, rl.py).

Agreement with TRL 1.16 (trl/trainer/grpo_trainer.py, `_generate_and_score_completions` and
`_compute_loss`) is pinned in tests/test_grpo.py and tests/test_grpo_variants.py. Where Relay
chooses:
- Every loss type's micro-batch loss is its share of the optimizer step's (grpo_losses.py), so
  `loss_type: dapo` (the default, TRL's default too) is the token mean over every completion token
  of the step, whatever the micro-batch split; TRL's `bnpo` divides by each micro-batch's tokens.
- One optimizer step covers the whole generation batch (TRL can split it over
  `steps_per_generation` steps); `num_iterations` repeats that step with the rollout's log-probs
  as the old policy.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from pipeline.algorithms import rl  # noqa: F401 - tests reach rl's functions through this module
from pipeline.algorithms.advantages import ADVANTAGE_EPS, group_advantages  # noqa: F401 - the stage's and tests' names
from pipeline.algorithms.grpo_losses import LOSS_TYPES, GRPOLossOut, Totals, grpo_loss, high_entropy_mask  # noqa: F401
from pipeline.engine.steps import all_reduce_sum, optimizer_step, pooled_means
from pipeline.rl.rollout import ActorCritic, Rollout, chunks


def loss_mask(rollout: Rollout, mask_truncated: bool) -> torch.Tensor:
    """The tokens the loss reads ([B, R]): the response's, less every token of a completion cut at
    max_new_tokens when `mask_truncated` (TRL's mask_truncated_completions)."""
    mask = rollout.response_mask
    return mask * rollout.finished.to(mask.dtype).unsqueeze(1) if mask_truncated else mask


def source_means(scores: torch.Tensor, names: list[str]) -> dict[str, float]:
    """`grpo/reward/{name}`: each reward source's mean over every rank's completions (`scores`
    [N, K], a column per name), NaN ("no opinion") left out as TRL's nanmean; NaN only where no
    completion of the step has that source's score. A mean of the ranks' means would weigh the
    ranks' scored completions unequally, and read NaN where one rank holds none."""
    means = scores.nanmean(0).tolist() if scores.numel() else [float("nan")] * len(names)
    return {f"grpo/reward/{name}": float(m) for name, m in zip(names, means)}


# ------------------------------------------------------------------------------------------
# Scoring and the update (models)
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def score_completions(
    model: ActorCritic, rollout: Rollout, *, micro: int, temperature: float, autocast, old: bool, reference: bool
) -> dict[str, torch.Tensor]:
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
                policy, _ = model(ids, mask, P, critic=False, temperature=temperature)
                out["old"].append(policy.logp.cpu())
            if reference:
                out["ref"].append(model.reference_logprobs(ids, mask, P, temperature).cpu())
    return {k: torch.cat(v) for k, v in out.items()}


def grpo_update(
    model, optimizer, rollout: Rollout, advantages: torch.Tensor, scored: dict, accelerator, cfg, step: int
) -> dict[str, float]:
    """`grpo.num_iterations` optimizer steps over the generation batch, each accumulated over
    `train.grad_accum` micro-batches in rollout order. Old log-probs are the rollout's ('old', or
    with one iteration the first forward's own, detached: the same numbers, one forward fewer).

    Returns the mean loss, clipfrac, kl (k3 per token, when beta > 0), grad_norm and
    `ratio_dev_first` (max |ratio - 1| of the first micro-batch before any update; 0 when 'old'
    is given, as it must be).

    Raises:
        NonFiniteError: a non-finite loss or gradient (before the optimizer steps).
    """
    g, accum = cfg.grpo, cfg.train.grad_accum
    micro = rollout.input_ids.shape[0] // accum
    mask_all = loss_mask(rollout, g.mask_truncated_completions)
    # The rollout lives on the host: its counts are read there (over ranks: one read per update).
    counts = all_reduce_sum(
        torch.tensor([float(mask_all.sum()), float(rollout.input_ids.shape[0])], dtype=torch.float64), accelerator
    )
    tokens, sequences = counts.tolist()
    totals = Totals(tokens, int(sequences), cfg.generation.max_new_tokens)
    # accelerator.backward divides each micro-batch's loss by accum; these losses are already
    # shares of the step's (and the ranks' mean gradient is wanted), so scale back up.
    scale = accum * accelerator.num_processes
    objective = g.objective()
    stats: dict[str, list[float]] = defaultdict(list)
    for _ in range(g.num_iterations):
        # Each micro-batch's figures ([loss, clipfrac(, kl)]) and the first one's ratio check stay
        # on the device until the step's one host read (optimizer_step).
        figures: list[torch.Tensor] = []
        first: list[torch.Tensor] = []
        counts: list[torch.Tensor] = []  # what each micro-batch's clipfrac (and kl) are means over

        def micro_batch(k: int, figures=figures, first=first, counts=counts) -> torch.Tensor:
            rows = slice(k * micro, (k + 1) * micro)
            out, ratio_dev = _micro_loss(
                model, rollout, scored, advantages, mask_all, rows, cfg, objective, totals, accelerator
            )
            accelerator.backward(out.loss * scale)
            if "ratio_dev_first" not in stats and not first:
                first.append(ratio_dev.view(1))
            parts = [out.loss.detach(), out.clipfrac] + ([] if out.kl is None else [out.kl])
            figures.append(torch.stack([part.double() for part in parts]))
            tokens = mask_all[rows].sum().to(out.clip_items.device)
            counts.append(torch.stack([out.clip_items.double(), tokens.double()][: len(parts) - 1]))
            return out.loss

        def step_figures(figures=figures, first=first, counts=counts) -> torch.Tensor:
            """[the step's loss (each rank holds its share), first's ratio check, every micro-batch's
            figures, the step's clipfrac (and kl) over all its items on every rank]"""
            table = torch.stack(figures)
            pooled = pooled_means(table[:, 1:], torch.stack(counts), accelerator)
            return torch.cat([all_reduce_sum(table[:, 0].sum().view(1), accelerator), *first, table.flatten(), pooled])

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
        _read_step(done, len(figures[0]), accum, bool(first), accelerator.num_processes, stats)
    return {k: sum(v) / len(v) for k, v in stats.items()}


def _micro_loss(
    model, rollout: Rollout, scored: dict, advantages, mask_all, rows: slice, cfg, objective, totals, accelerator
) -> tuple[GRPOLossOut, torch.Tensor]:
    """One micro-batch's forward and loss, and its max |ratio - 1| (the first one's is the step's
    on-policy check), on the device."""
    g, device = cfg.grpo, accelerator.device
    ids, attn = rollout.input_ids[rows].to(device), rollout.attention_mask[rows].to(device)
    mask = mask_all[rows].to(device)
    with accelerator.autocast():
        policy, _ = model(
            ids,
            attn,
            rollout.prompt_width,
            critic=False,
            temperature=cfg.generation.temperature,
            entropy=g.top_entropy_quantile < 1.0,
        )
    logp = policy.logp
    old = scored["old"][rows].to(device) if "old" in scored else logp.detach()
    ref = scored["ref"][rows].to(device) if "ref" in scored else None
    # untrained positions (padding, a tool rollout's inserted results): their log-probs are never read
    logp, old, ref = (None if t is None else t.masked_fill(mask == 0, 0.0) for t in (logp, old, ref))
    out = grpo_loss(
        logp,
        old,
        advantages[rows].to(device),
        mask,
        ref_logp=ref,
        objective=objective,
        totals=totals,
        token_filter=_entropy_filter(policy.entropy, mask, g.top_entropy_quantile, accelerator),
        is_weight=scored["is_weight"][rows].to(device) if "is_weight" in scored else None,  # mismatch correction
    )
    ratio_dev = ((logp.detach() - old).exp() - 1).abs().mul(mask).max().double()
    return out, ratio_dev


def _read_step(done, width: int, accum: int, has_first: bool, ranks: int, stats: dict) -> None:
    """Add one optimizer step's figures, read from the host once (`optimizer_step`'s `figures`:
    [the step's loss, first's ratio check when `has_first`, every micro-batch's row]), to `stats`."""
    read = done.figures.tolist()
    pooled, read = read[len(read) - (width - 1) :], read[: len(read) - (width - 1)]
    micro_rows = [read[len(read) - width * (accum - i) :][:width] for i in range(accum)]
    if has_first:
        stats["ratio_dev_first"].append(read[1])
    stats["clipfrac"].append(pooled[0])
    if width > 2:
        stats["kl"].append(pooled[1])
    # one process: the host sums the micro-batches' losses in their order (the float of each
    # micro-batch's own read); over ranks, the sum all-reduced on the device
    stats["loss"].append(sum(row[0] for row in micro_rows) if ranks == 1 else read[0])
    stats["grad_norm"].append(done.grad_norm)


@torch.no_grad()
def _entropy_filter(entropies, mask: torch.Tensor, quantile: float, accelerator):
    """The high-entropy loss tokens of a micro-batch (None when quantile is 1: every token), the
    threshold taken over every rank's micro-batch tokens as TRL's `get_high_entropy_mask` does.
    `entropies` [B, R]: each position's, from the policy's forward (`PolicyOut.entropy`)."""
    if quantile >= 1.0:
        return None
    if accelerator.num_processes == 1:  # the threshold found on the device (no host read)
        return high_entropy_mask(entropies, mask, quantile)
    pad = -1e9  # entropies are >= 0, so the sentinel cannot collide with a value
    pool = accelerator.gather(accelerator.pad_across_processes(entropies[mask.bool()], dim=0, pad_index=pad))
    return high_entropy_mask(entropies, mask, quantile, pool[pool != pad])
