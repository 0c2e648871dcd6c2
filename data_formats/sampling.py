"""The batch order every stage draws by: the epoch permutation and the cursor through it, and
the weighted mix of data entries (`SourceMix`, data.weights) that replaces the permutation when
the config weighs its sources.

All are pure functions of their inputs and a seed (their own torch Generator, never the global
RNG), so a resumed run rebuilds the exact order and skips the steps already done.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

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
    n: int,
    cursor: DataCursor,
    *,
    seed: int,
    batch_size: int,
    grad_accum: int,
    world_size: int = 1,
    rank: int = 0,
    order_of: Optional[Callable[[int], Sequence[int]]] = None,
) -> tuple[list[list[int]], DataCursor]:
    """Sample indices of this rank's `grad_accum` micro-batches for one optimizer step, and the
    cursor after them.

    A global micro-batch is the next `batch_size * world_size` samples of the epoch order from the
    cursor; rank r takes its r-th slice. So one optimizer step covers the same samples for any
    split of the global batch into ranks x micro-batches x batch size, and a split changed
    mid-epoch goes on where the last one stopped. The epoch's rest, once shorter than a global
    micro-batch, is not used (the stage logs how many through `epoch_tail`): as it depends on the
    global micro-batch, two splits draw the same samples past an epoch's end only when the epoch
    fills whole micro-batches of both.

    `order_of(epoch)`, when given, is the epoch's order instead of a permutation of range(n) (a
    weighted mix, `SourceMix.epoch_order`, whose epochs may differ in length). Its draws are a
    stream that nothing leaves out: a global micro-batch the epoch's rest does not fill is
    finished with the next epoch's first draws (an epoch boundary inside a micro-batch), so every
    draw of every epoch trains, for any split and across a resume.

    Hand-written rather than a DataLoader + DistributedSampler because exact resume needs the
    order to be a pure function of (seed, epoch, position).

    Raises:
        ValueError: fewer samples (in an epoch's order) than one global micro-batch.
    """
    per_global = batch_size * world_size
    carry = order_of is not None  # a weighted mix's draws carry over into the next epoch
    if order_of is None:
        if n < per_global:
            raise ValueError(
                f"{n} training samples cannot fill one global micro-batch of {per_global} (batch_size x ranks)"
            )
        order_of = lambda e: epoch_order(n, seed, e)  # noqa: E731
    epoch, done = cursor.epoch, cursor.samples
    order = _filling(order_of, epoch, per_global)
    out = []
    for _ in range(grad_accum):
        if carry:
            drawn: list[int] = []
            while len(drawn) < per_global:
                if done >= len(order):
                    epoch, done = epoch + 1, 0
                    order = _filling(order_of, epoch, per_global)
                take = min(per_global - len(drawn), len(order) - done)
                drawn += order[done : done + take]
                done += take
            out.append(drawn[rank * batch_size : (rank + 1) * batch_size])
            continue
        if done + per_global > len(order):
            epoch, done = epoch + 1, 0
            order = _filling(order_of, epoch, per_global)
        start = done + rank * batch_size
        out.append(order[start : start + batch_size])
        done += per_global
    return out, DataCursor(epoch, done)


def _filling(order_of: Callable[[int], Sequence[int]], epoch: int, per_global: int) -> Sequence[int]:
    order = order_of(epoch)
    if len(order) < per_global:
        raise ValueError(
            f"epoch {epoch} holds {len(order)} training sample(s), fewer than one global micro-batch of "
            f"{per_global} (batch_size x ranks)"
        )
    return order


def legacy_cursor(saved: dict, global_micro_batch: int | None) -> DataCursor:
    """A checkpoint's data cursor: {epoch, samples}, or a checkpoint written before the cursor
    counted samples ({epoch, position} in global micro-batches of `global_micro_batch`)."""
    if "position" not in saved:
        return DataCursor(**saved)
    return DataCursor(int(saved["epoch"]), int(saved["position"]) * int(global_micro_batch or 0))


def epoch_tail(n: int, batch_size: int, world_size: int) -> int:
    """How many samples per epoch `next_micro_batches` leaves unused."""
    return n % (batch_size * world_size)


# ------------------------------------------------------------------------------------------
# Weighted source mixing (data.weights, data.mix_stop)
# ------------------------------------------------------------------------------------------

MIX_STOPS = ("first_exhausted", "all_exhausted")
"""The named ends of a weighted epoch (besides a number of samples), as `datasets.interleave_datasets`
names its stopping strategies."""
DRAW_BLOCK = 4096


def seed_of(*parts: int) -> int:
    """A generator seed for `parts` (a hash: nearby seeds, epochs and sources draw unrelated orders)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def mixed_epoch_order(
    sizes: Sequence[int], weights: Sequence[float], stop: Union[str, int], seed: int, epoch: int
) -> list[int]:
    """One epoch of a weighted mix: indices into the concatenation of the sources (source k's
    samples are offset by the sizes before it).

    Each draw picks source k with probability weights[k] (normalised; LLaMA-Factory's
    `interleave_probs`, OpenRLHF's `dataset_probs`) and takes its next sample in the source's own
    shuffled order. `stop`: 'first_exhausted' ends the epoch with the draw that takes the last
    sample of any source; 'all_exhausted' once every source has given all of its samples, a source
    that ran out starting over (reshuffled, so small sources are oversampled); a number ends it after
    that many draws, sources starting over as needed. A pure function of its arguments.

    Raises:
        ValueError: no source with samples and a positive weight.
    """
    live = [k for k, (n, w) in enumerate(zip(sizes, weights)) if n > 0 and w > 0]
    if not live:
        raise ValueError("no weighted source has a sample")
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    probs = torch.tensor([float(weights[k]) if k in live else 0.0 for k in range(len(sizes))], dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed_of(seed, epoch, "mix"))
    orders = {k: _source_order(sizes[k], seed, epoch, k, 0) for k in live}
    taken, passes, exhausted, out = dict.fromkeys(live, 0), dict.fromkeys(live, 0), set(), []
    target = stop if isinstance(stop, int) else None
    while True:
        for k in torch.multinomial(probs, DRAW_BLOCK, replacement=True, generator=generator).tolist():
            if taken[k] == sizes[k]:
                passes[k] += 1
                orders[k], taken[k] = _source_order(sizes[k], seed, epoch, k, passes[k]), 0
            out.append(offsets[k] + orders[k][taken[k]])
            taken[k] += 1
            if taken[k] == sizes[k]:
                exhausted.add(k)
            if (
                len(out) == target
                or (stop == "first_exhausted" and exhausted)
                or (stop == "all_exhausted" and len(exhausted) == len(live))
            ):
                return out


def _source_order(n: int, seed: int, epoch: int, source: int, passes: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed_of(seed, epoch, source, passes))
    return torch.randperm(n, generator=generator).tolist()


def sample_tokens(sample: dict) -> int:
    """The tokens a training item holds (a row's, a pair's two sides, a prompt's)."""
    return sum(len(v) for k, v in sample.items() if k.endswith("input_ids") or k == "prompt_ids")


@dataclass
class SourceMix:
    """The weighted mix of a split's data entries: which entry each sample came from, and the
    epoch orders `next_micro_batches` draws (see `mixed_epoch_order`)."""

    names: list[str]
    """The data entries, in the config's order."""
    weights: list[float]
    """Normalised to sum 1."""
    stop: Union[str, int]
    seed: int
    entry_of: list[int]
    """The entry (an index into `names`) each of the split's samples came from."""
    labels: list[str] = field(default_factory=list)
    """Short names of the entries for the logged figures (default: `names`)."""
    members: list[list[int]] = field(default_factory=list, repr=False)
    """The indices into the split's samples of each entry's samples."""
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        total = float(sum(self.weights))
        self.weights = [float(w) / total for w in self.weights]
        self.labels = list(self.labels) or list(self.names)
        self.members = [[] for _ in self.names]
        for i, k in enumerate(self.entry_of):
            self.members[k].append(i)

    @property
    def sizes(self) -> list[int]:
        return [len(m) for m in self.members]

    def epoch_order(self, epoch: int) -> list[int]:
        """`epoch`'s sample indices (into the split's samples), the last two epochs asked for kept
        (a micro-batch across an epoch boundary reads both, once per rank)."""
        if epoch not in self._cache:
            flat = [i for m in self.members for i in m]
            while len(self._cache) >= 2:
                del self._cache[next(iter(self._cache))]
            self._cache[epoch] = [
                flat[j] for j in mixed_epoch_order(self.sizes, self.weights, self.stop, self.seed, epoch)
            ]
        return self._cache[epoch]

    def shortest_epoch(self) -> int:
        """A bound below every epoch's length: taking a source's last sample takes all of it."""
        live = [n for n, w in zip(self.sizes, self.weights) if n and w]
        if isinstance(self.stop, int):
            return self.stop
        return min(live) if self.stop == "first_exhausted" else max(live)

    def step_figures(self, samples: Sequence, indices: Sequence[int]) -> dict[str, float]:
        """`data/samples/<label>` and `data/tokens/<label>` of the global batch `indices`."""
        figures = {}
        for k, name in enumerate(self.labels):
            chosen = [i for i in indices if self.entry_of[i] == k]
            figures[f"data/samples/{name}"] = float(len(chosen))
            figures[f"data/tokens/{name}"] = float(sum(sample_tokens(samples[i]) for i in chosen))
        return figures

    def describe(self) -> dict:
        """What the manifest records: the entries, their weights and sizes, the policy and seed."""
        return {
            "sources": [
                {"entry": n, "weight": w, "samples": s} for n, w, s in zip(self.names, self.weights, self.sizes)
            ],
            "stop": self.stop,
            "seed": self.seed,
        }
