"""Sampling orders: the epoch order and cursor every stage draws batches by, per-task weighted
sampling (multitask SFT) and length grouping (padding).

All are pure functions of their inputs and a seed (their own numpy or torch Generator, never the
global RNG), so a resumed run can rebuild the exact order and skip the steps already done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np
import torch


def task_sampling_order(task_ids: Sequence[int], weights: Mapping[int, float], seed: int,
                        num_samples: Optional[int] = None) -> list[int]:
    """Sample indices where each draw picks task t with probability weights[t] / sum(weights)
    (tasks missing from `weights` get weight 0 unless `weights` is empty: then every task has
    weight 1, i.e. uniform over tasks), then the next sample of that task from a per-task
    shuffle that is reshuffled each time the task is exhausted (so every sample of a task is
    seen before any repeats).

    Raises:
        ValueError: a negative weight, a weight for a task with no samples, or all weights zero.
    """
    task_ids = np.asarray(task_ids, dtype=np.int64)
    num_samples = len(task_ids) if num_samples is None else num_samples
    tasks = sorted(set(task_ids.tolist()))
    if not tasks or num_samples == 0:
        return []
    w = {t: 1.0 for t in tasks} if not weights else {t: float(weights.get(t, 0.0)) for t in tasks}
    unknown = sorted(set(weights) - set(tasks))
    if unknown:
        raise ValueError(f"sampling weights given for task id(s) with no samples: {unknown}")
    if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
        raise ValueError(f"sampling weights must be >= 0 with a positive sum, got {w}")
    rng = np.random.default_rng(seed)
    probs = np.array([w[t] for t in tasks]) / sum(w.values())
    pools = {t: np.flatnonzero(task_ids == t) for t in tasks}
    queues: dict[int, list[int]] = {t: [] for t in tasks}
    order = []
    for choice in rng.choice(len(tasks), size=num_samples, p=probs):
        t = tasks[choice]
        if not queues[t]:
            queues[t] = rng.permutation(pools[t]).tolist()
        order.append(queues[t].pop())
    return order


def length_grouped_order(lengths: Sequence[int], batch_size: int, seed: int, mega: int = 50) -> list[int]:
    """A shuffled order in which each batch holds samples of similar length (less padding):
    shuffle, cut into mega-batches of `mega * batch_size`, sort each by length (longest first),
    then shuffle the batches. The same idea as transformers' LengthGroupedSampler, written as a
    pure function of a seed so resume can replay it.

    Raises:
        ValueError: batch_size or mega < 1.
    """
    if batch_size < 1 or mega < 1:
        raise ValueError(f"batch_size and mega must be >= 1, got {batch_size}, {mega}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths)).tolist()
    size = mega * batch_size
    grouped = []
    for start in range(0, len(order), size):
        chunk = sorted(order[start:start + size], key=lambda i: -lengths[i])
        grouped += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    return [i for k in rng.permutation(len(grouped)).tolist() for i in grouped[k]]


# ------------------------------------------------------------------------------------------
# Data order: a pure function of (seed, epoch) plus a cursor, so a resumed run sees the same batches
# ------------------------------------------------------------------------------------------


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The sample order of `epoch`: a permutation of range(n) that depends only on seed and epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


@dataclass
class DataCursor:
    """Where the data stream stands: `position` global micro-batches consumed in `epoch`."""

    epoch: int = 0
    position: int = 0


def next_micro_batches(
    n: int, cursor: DataCursor, *, seed: int, batch_size: int, grad_accum: int, world_size: int = 1, rank: int = 0
) -> tuple[list[list[int]], DataCursor]:
    """Sample indices of this rank's `grad_accum` micro-batches for one optimizer step, and the
    cursor after them.

    A global micro-batch is `batch_size * world_size` consecutive samples of the epoch order; rank
    r takes its r-th slice. So one optimizer step covers the same samples for any split of the
    global batch into ranks x micro-batches x batch size. An epoch's tail shorter than a global
    micro-batch is not used (build_run logs how many through `epoch_tail`).

    Hand-written rather than a DataLoader + DistributedSampler because exact resume needs the
    order to be a pure function of (seed, epoch, position).

    Raises:
        ValueError: fewer samples than one global micro-batch.
    """
    per_global = batch_size * world_size
    if n < per_global:
        raise ValueError(f"{n} training samples cannot fill one global micro-batch of {per_global} (batch_size x ranks)")
    per_epoch = n // per_global
    epoch, position = cursor.epoch, cursor.position
    order = epoch_order(n, seed, epoch)
    out = []
    for _ in range(grad_accum):
        if position >= per_epoch:
            epoch, position = epoch + 1, 0
            order = epoch_order(n, seed, epoch)
        start = position * per_global + rank * batch_size
        out.append(order[start : start + batch_size])
        position += 1
    return out, DataCursor(epoch, position)


def epoch_tail(n: int, batch_size: int, world_size: int) -> int:
    """How many samples per epoch `next_micro_batches` leaves unused."""
    return n % (batch_size * world_size)
