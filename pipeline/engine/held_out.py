"""The held-out loop every evaluating stage runs, with one rule for a short rank's padding batch.

A stage gives a function of one batch's sample indices that returns that batch's figures as sums
(a loss summed over its tokens or pairs, the number of pairs, ...); `held_out` adds them up over
this rank's share of the held-out samples and over every rank, and the stage divides (`ratio`).

The padding rule: samples are dealt round-robin (`eval_shards`) and every rank runs the same number
of batches, because sharded engines (FSDP, ZeRO-3) need all ranks in every forward. A rank whose
share runs out runs a padding batch (its first samples again): the forward runs, and its figures
count as zeros. So every sample is counted once, and N ranks give the sums of one process, whatever
the number of held-out samples.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable, Optional, Sequence, TypeVar

import torch

from pipeline.engine.steps import all_reduce_sum, token_losses
from pipeline.modeling.models import eval_mode

Item = TypeVar("Item")
Figures = dict[str, "torch.Tensor | float | int"]


def eval_shards(
    n: int, batch_size: int, world_size: int, rank: int, max_batches: Optional[int] = None
) -> list[tuple[list[int], bool]]:
    """This rank's evaluation batches as (sample indices, counts?) pairs, the same number on every rank.

    Samples are dealt round-robin; a rank whose share runs out repeats its first batch with
    counts=False (the forward runs, its figures are not counted), so no sample is counted twice.
    A cap of `max_batches` below the number of batches takes that many spread evenly over the set
    (the first, then every (batches / cap)-th), not the first ones: a held-out file grouped by
    task, or KTO's desirable answers before its undesirable ones, is sampled across its groups.
    """
    mine = list(range(rank, n, world_size))
    per_rank = math.ceil(math.ceil(n / world_size) / batch_size) if n else 0
    picked = range(per_rank)
    if max_batches is not None and max_batches < per_rank:
        picked = [b * per_rank // max_batches for b in range(max_batches)]
    out = []
    for b in picked:
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        out.append((chunk, True) if chunk else (list(range(min(batch_size, n))), False))
    return out


@torch.no_grad()
def held_out(
    shards: Iterable[tuple[Item, bool]], figures: Callable[[Item], Figures], accelerator
) -> dict[str, torch.Tensor]:
    """Each figure's sum over the counted batches of every rank (float64 tensors on the CPU, of the
    shape `figures` gives it): `figures(item)` runs for every batch, padding batches included, and
    a padding batch (counts False) adds zeros. One all-reduce at the end, one host read.

    Every rank must pass as many batches as the others (`eval_shards`) and `figures` must return
    the same keys and shapes for every batch.
    """
    sums: dict[str, torch.Tensor] = {}
    for item, counts in shards:
        for key, value in figures(item).items():
            value = torch.as_tensor(value).detach().double()
            if not counts:
                value = torch.zeros_like(value)
            sums[key] = sums[key] + value.to(sums[key].device) if key in sums else value
    keys = sorted(sums)
    if not keys:
        return {}
    flat = torch.cat([sums[k].reshape(-1).cpu() for k in keys])
    flat = all_reduce_sum(flat, accelerator).cpu()
    out, at = {}, 0
    for key in keys:
        size = sums[key].numel()
        out[key] = flat[at : at + size].reshape(sums[key].shape)
        at += size
    return out


def ratio(sums: dict[str, torch.Tensor], key: str, count: str) -> float:
    """sums[key] / sums[count] as a number; NaN where the count is 0 (no held-out sample counted)."""
    total = float(sums[count]) if count in sums else 0.0
    return float(sums[key]) / total if total else float("nan")


def token_loss_sums(model: torch.nn.Module, batch: dict, accelerator, num_tasks: int = 1) -> dict[str, torch.Tensor]:
    """One LM batch's figures for `held_out`: the summed token losses of each task and its supervised
    tokens ([num_tasks] each)."""
    autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
    with autocast:
        losses, tasks = token_losses(model, batch, accelerator)
    valid = tasks >= 0
    sums = torch.zeros(num_tasks, dtype=torch.float64, device=losses.device)
    counts = torch.zeros(num_tasks, dtype=torch.float64, device=losses.device)
    sums.index_add_(0, tasks[valid], losses[valid].double())
    counts.index_add_(0, tasks[valid], torch.ones(int(valid.sum()), dtype=torch.float64, device=losses.device))
    return {"loss": sums, "tokens": counts}


def token_loss_result(sums: dict[str, torch.Tensor], num_tasks: int) -> dict:
    """{'loss', 'ppl', 'task_losses' (nan where a task has no tokens), 'tokens'} from `held_out`'s
    sums of `token_loss_sums`."""
    loss_sums = sums.get("loss", torch.zeros(num_tasks, dtype=torch.float64))
    counts = sums.get("tokens", torch.zeros(num_tasks, dtype=torch.float64))
    total = float(counts.sum())
    loss = float(loss_sums.sum() / total) if total > 0 else float("nan")
    per_task = [float(loss_sums[t] / counts[t]) if counts[t] > 0 else float("nan") for t in range(num_tasks)]
    return {
        "loss": loss,
        "ppl": math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan"),
        "task_losses": per_task,
        "tokens": total,
    }


def heldout_token_loss(model: torch.nn.Module, batches: Sequence[dict], accelerator, num_tasks: int = 1) -> dict:
    """Token-mean loss over `batches` (this rank's share, every one counted) reduced over ranks,
    per task too; see `token_loss_result`. Every rank must pass the same number of batches."""
    with eval_mode(model):
        sums = held_out(
            ((b, True) for b in batches), lambda b: token_loss_sums(model, b, accelerator, num_tasks), accelerator
        )
    return token_loss_result(sums, num_tasks)
