"""Sampling orders: per-task weighted sampling (multitask SFT) and length grouping (padding).

Both are pure functions of their inputs and a seed (numpy's Generator, never the global RNG), so a
resumed run can rebuild the exact order and skip the steps already done.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np


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
