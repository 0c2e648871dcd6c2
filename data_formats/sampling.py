"""The batch order every stage draws by: the epoch permutation and the cursor through it.

Both are pure functions of their inputs and a seed (their own torch Generator, never the global
RNG), so a resumed run rebuilds the exact order and skips the steps already done.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The sample order of `epoch`: a permutation of range(n) that depends only on seed and epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


@dataclass
class DataCursor:
    """Where the data stream stands: `samples` of `epoch`'s order consumed (samples, not batches:
    a run resumed with another batch_size x grad_accum split or another number of ranks goes on
    at the next unseen sample)."""

    epoch: int = 0
    samples: int = 0


def next_micro_batches(
    n: int, cursor: DataCursor, *, seed: int, batch_size: int, grad_accum: int, world_size: int = 1, rank: int = 0
) -> tuple[list[list[int]], DataCursor]:
    """Sample indices of this rank's `grad_accum` micro-batches for one optimizer step, and the
    cursor after them.

    A global micro-batch is the next `batch_size * world_size` samples of the epoch order from the
    cursor; rank r takes its r-th slice. So one optimizer step covers the same samples for any
    split of the global batch into ranks x micro-batches x batch size, and a split changed
    mid-epoch goes on where the last one stopped. The epoch's rest, once shorter than a global
    micro-batch, is not used (build_run logs how many through `epoch_tail`).

    Hand-written rather than a DataLoader + DistributedSampler because exact resume needs the
    order to be a pure function of (seed, epoch, position).

    Raises:
        ValueError: fewer samples than one global micro-batch.
    """
    per_global = batch_size * world_size
    if n < per_global:
        raise ValueError(f"{n} training samples cannot fill one global micro-batch of {per_global} (batch_size x ranks)")
    epoch, done = cursor.epoch, cursor.samples
    order = epoch_order(n, seed, epoch)
    out = []
    for _ in range(grad_accum):
        if done + per_global > n:
            epoch, done = epoch + 1, 0
            order = epoch_order(n, seed, epoch)
        start = done + rank * batch_size
        out.append(order[start : start + batch_size])
        done += per_global
    return out, DataCursor(epoch, done)


def legacy_cursor(saved: dict, global_micro_batch: int | None) -> DataCursor:
    """A checkpoint's data cursor: {epoch, samples}, or a checkpoint written before the cursor
    counted samples ({epoch, position} in global micro-batches of `global_micro_batch`)."""
    if "position" not in saved:
        return DataCursor(**saved)
    return DataCursor(int(saved["epoch"]), int(saved["position"]) * int(global_micro_batch or 0))


def epoch_tail(n: int, batch_size: int, world_size: int) -> int:
    """How many samples per epoch `next_micro_batches` leaves unused."""
    return n % (batch_size * world_size)
