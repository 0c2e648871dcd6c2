"""Batches: dynamic padding, or packing several samples per row without contamination; and the
preference-pair batches of the RM and DPO stages (`PairCollator`, `AnswerPairCollator`,
`PackedPairCollator`).

Batch layout (ARCHITECTURE.md): input_ids, labels, position_ids, task_ids [B, T]; attention_mask
[B, T] when padding; segment_ids [B, T] when packing: which sample of its row each slot holds (the
padding tail is a segment of its own), with position_ids restarting at 0 for each sample.

A packed batch carries no attention mask: what keeps a sample blind to the others in its row
depends on the attention implementation (a 4D block-causal mask for sdpa/eager, a document
BlockMask for flex attention, varlen `cu_seq_lens` for flash-attention), and
`pipeline.modeling.attention.document_attention` builds it from the segment ids on the model's
device. So the collator ships [B, T] integers instead of a [B, 1, T, T] mask built on the CPU
and copied over each micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

IGNORE_INDEX = -100
PADDING_MODES = ("padding", "pack")
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flex_attention")


def _segments(sample: dict) -> list[int]:
    lengths = sample.get("lengths")
    return list(lengths) if lengths else [len(sample["input_ids"])]


def _token_tasks(sample: dict) -> list[int]:
    if "task_ids" in sample:
        return list(sample["task_ids"])
    return [int(sample.get("task_id", 0))] * len(sample["input_ids"])


def _in_order_groups(lengths: list[int], seq_length: int) -> list[list[int]]:
    """Samples in order into the current row until the next one does not fit."""
    groups: list[list[int]] = []
    load = 0
    for i, n in enumerate(lengths):
        if not groups or load + n > seq_length:
            groups.append([])
            load = 0
        groups[-1].append(i)
        load += n
    return groups


def _balanced_groups(lengths: list[int], seq_length: int) -> list[list[int]]:
    """k = ceil(total / seq_length) rows, each sample, longest first, onto the row with the fewest
    tokens (longest-processing-time first); one more row while a row would exceed `seq_length`
    (ends by one row per sample). Ties go to the earlier sample and row."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    count = max(1, -(-sum(lengths) // seq_length))
    while True:
        loads, groups = [0] * count, [[] for _ in range(count)]
        for i in order:
            row = min(range(count), key=lambda r: (loads[r], r))
            loads[row] += lengths[i]
            groups[row].append(i)
        if max(loads) <= seq_length:
            return [sorted(g) for g in groups if g]
        count += 1


def pack(samples: list[dict], seq_length: int) -> list[dict]:
    """Samples -> rows of at most `seq_length` tokens with the fewest padded slots: a batch is padded
    to its longest row, so its cost is rows x longest row. Of two layouts, the one with fewer slots
    (the balanced one on a tie): rows of even length (`_balanced_groups`) or samples in order until
    the next does not fit. So never more padding than in-order packing. Within a row the samples
    keep their order; rows are ordered by their first sample.

    Each row has input_ids, labels (the first token of every sample set to -100, since nothing in
    its own sample precedes it), task_ids per token, `lengths` (the samples' lengths) and `samples`
    (their indices in `samples`, in the row's order).

    Raises:
        ValueError: a sample is longer than `seq_length` or empty.
    """
    lengths = [len(sample["input_ids"]) for sample in samples]
    for i, n in enumerate(lengths):
        if n == 0 or n > seq_length:
            raise ValueError(f"sample {i} has {n} tokens; packing needs 1..{seq_length}")
    if not samples:
        return []

    def slots(groups: list[list[int]]) -> int:
        return len(groups) * max(sum(lengths[i] for i in g) for g in groups)

    layouts = (_balanced_groups(lengths, seq_length), _in_order_groups(lengths, seq_length))
    groups = sorted(min(layouts, key=slots), key=lambda g: g[0])
    rows: list[dict] = []
    for indices in groups:
        row = {"input_ids": [], "labels": [], "task_ids": [], "lengths": [], "samples": indices}
        for i in indices:
            sample = samples[i]
            labels = list(sample.get("labels", sample["input_ids"]))
            labels[0] = IGNORE_INDEX
            row["input_ids"] += list(sample["input_ids"])
            row["labels"] += labels
            row["task_ids"] += _token_tasks(sample)
            row["lengths"].append(lengths[i])
        rows.append(row)
    return rows


def packing_efficiency(rows: list[dict], seq_length: int) -> float:
    """Real tokens / token slots over packed rows of `seq_length` (1.0 = no padding)."""
    if not rows:
        return 0.0
    return sum(len(r["input_ids"]) for r in rows) / (len(rows) * seq_length)


def segment_ids(lengths: list[int], total: int) -> tuple[list[int], list[int]]:
    """(segment id, position) per slot of a row of `total` slots holding `lengths`; the padding
    tail is its own segment (so no real token attends to it, and it never has an empty row)."""
    seg, pos = [], []
    for k, n in enumerate(lengths):
        seg += [k] * n
        pos += list(range(n))
    tail = total - len(seg)
    seg += [len(lengths)] * tail
    pos += list(range(tail))
    return seg, pos


def common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading tokens every sequence shares, leaving each at least one token of its own
    (the prefill's last position is a row's own)."""
    limit, first, n = min(len(s) for s in seqs) - 1, seqs[0], 0
    while n < limit and all(s[n] == first[n] for s in seqs):
        n += 1
    return n


def shared_first_pad(seqs: list[list[int]], pad_id: int, shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) with each row laid out [its first `shared` tokens | padding | the
    rest], as wide as the longest sequence: `left_pad` with the padding moved after a shared opening
    (pipeline.modeling.decode.prompt_layout)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        pads = width - len(seq)
        ids[row] = torch.tensor(seq[:shared] + [pad_id] * pads + seq[shared:], dtype=torch.long)
        mask[row] = torch.tensor([1] * shared + [0] * pads + [1] * (len(seq) - shared), dtype=torch.long)
    return ids, mask


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (input_ids, attention_mask) for generation or reward scoring at the last token.

    Raises:
        ValueError: no sequences, or an empty one.
    """
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("left_pad needs at least one sequence and no empty ones")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


class Collator:
    """Turns a list of samples into a batch (see the module docstring).

    padding: samples (dicts with input_ids, optional labels and task_id) are right-padded to the
    longest in the batch. pack: rows from `pack` (with `lengths`, at most `seq_length` tokens) are
    padded to the longest row in the batch, with `segment_ids` in place of an attention mask; plain
    samples given in pack mode are first packed greedily, so a batch may have fewer rows than
    samples. `attn_implementation` is checked here (a bad name fails when the data is built, before
    the model loads); the batch is the same for every implementation.
    """

    def __init__(
        self,
        pad_token_id: int,
        padding_mode: str = "padding",
        seq_length: Optional[int] = None,
        attn_implementation: str = "sdpa",
    ):
        """Raises:
        ValueError: unknown mode or attention kind; pack mode without seq_length.
        """
        if padding_mode not in PADDING_MODES:
            raise ValueError(f"padding_mode must be one of {PADDING_MODES}, got {padding_mode!r}")
        if attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation must be one of {ATTENTION}, got {attn_implementation!r}")
        if padding_mode == "pack" and not seq_length:
            raise ValueError("padding_mode='pack' needs seq_length")
        self.pad_token_id = pad_token_id
        self.padding_mode = padding_mode
        self.seq_length = seq_length
        self.attn_implementation = attn_implementation

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        """Raises:
        ValueError: empty batch; a packed row in padding mode; a row longer than seq_length.
        """
        if not samples:
            raise ValueError("cannot collate an empty batch")
        if self.padding_mode == "pack":
            return self._packed(samples)
        if any(len(_segments(s)) > 1 for s in samples):
            raise ValueError("packed rows (several samples per row) need padding_mode='pack'")
        width = max(len(s["input_ids"]) for s in samples)
        return self._tensors(samples, width, packed=False)

    def _packed(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        rows = [s for s in samples if "lengths" in s]
        plain = [s for s in samples if "lengths" not in s]
        rows += pack(plain, self.seq_length) if plain else []
        for row in rows:
            if len(row["input_ids"]) > self.seq_length:
                raise ValueError(f"packed row of {len(row['input_ids'])} tokens > seq_length {self.seq_length}")
        # Padded to the longest row, not to seq_length: the last rows of a short batch would
        # otherwise be computed on padding (the loss is the same either way).
        return self._tensors(rows, max(len(row["input_ids"]) for row in rows), packed=True)

    def _tensors(self, rows: list[dict], width: int, packed: bool) -> dict[str, torch.Tensor]:
        b = len(rows)
        input_ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
        task_ids = torch.full((b, width), -1, dtype=torch.long)
        position_ids = torch.zeros((b, width), dtype=torch.long)
        segments = torch.zeros((b, width), dtype=torch.long)
        attention = torch.zeros((b, width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[i, :n] = torch.tensor(row["input_ids"], dtype=torch.long)
            labels[i, :n] = torch.tensor(row.get("labels", row["input_ids"]), dtype=torch.long)
            task_ids[i, :n] = torch.tensor(_token_tasks(row), dtype=torch.long)
            attention[i, :n] = 1
            seg, pos = segment_ids(_segments(row), width)
            segments[i] = torch.tensor(seg, dtype=torch.long)
            position_ids[i] = torch.tensor(pos, dtype=torch.long)
        batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "task_ids": task_ids}
        if not packed:
            batch["attention_mask"] = attention
        else:
            batch["segment_ids"] = segments
        return batch


# --------------------------------------------------------------------------------------------
# Preference pairs (RM, DPO): rows [0, B) are the chosen sides, [B, 2B) the rejected ones
# --------------------------------------------------------------------------------------------


def _sides(pairs: Sequence[dict]) -> list[tuple[list[int], int]]:
    """(ids, answer length) of every side: the chosen ones, then the rejected ones."""
    return [(p["chosen_input_ids"], p["chosen_answer_len"]) for p in pairs] + [
        (p["rejected_input_ids"], p["rejected_answer_len"]) for p in pairs
    ]


@dataclass
class PairCollator:
    """Pairs -> one right-padded batch: rows [0, B) are the chosen sides, [B, 2B) the rejected ones,
    so one forward scores both (the RM's batches)."""

    pad_token_id: int

    def __call__(self, pairs: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [p["chosen_input_ids"] for p in pairs] + [p["rejected_input_ids"] for p in pairs]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        margin = torch.tensor([float(p.get("margin") or 0.0) for p in pairs], dtype=torch.float32)
        return {"input_ids": ids, "attention_mask": mask, "margin": margin}


@dataclass
class AnswerPairCollator:
    """Pairs -> one right-padded batch (rows as PairCollator's) with `labels` set on each side's
    answer tokens (its last `*_answer_len` tokens, end-of-turn included) and -100 on the prompt
    and the padding (DPO's batches)."""

    pad_token_id: int

    def __call__(self, pairs: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = PairCollator(self.pad_token_id)(pairs)
        del batch["margin"]
        labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        for row, (ids, answer) in enumerate(_sides(pairs)):
            labels[row, len(ids) - answer : len(ids)] = batch["input_ids"][row, len(ids) - answer : len(ids)]
        batch["labels"] = labels
        return batch


@dataclass
class PackedPairCollator:
    """Pairs -> packed rows (DPO's `data.padding_mode: pack`): every side is one sample labelled on
    its answer (the chosen sides, then the rejected ones), packed by `pack`, whose
    segment ids (per-document attention, pipeline.modeling.attention) and restarting positions keep
    each side blind to the others in its row; plus
    `sample_index` [R, T], the side each position belongs to (-1: padding), in the padded batch's
    order (chosen 0..B-1, rejected B..2B-1)."""

    pad_token_id: int
    seq_length: int
    attn_implementation: str = "sdpa"

    def __call__(self, pairs: Sequence[dict]) -> dict[str, torch.Tensor]:
        samples = [
            {"input_ids": list(ids), "labels": [IGNORE_INDEX] * (len(ids) - n) + list(ids[len(ids) - n :])}
            for ids, n in _sides(pairs)
        ]
        rows = pack(samples, self.seq_length)
        batch = Collator(self.pad_token_id, "pack", self.seq_length, self.attn_implementation)(rows)
        index = torch.full(batch["input_ids"].shape, -1, dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for sample, n in zip(row["samples"], row["lengths"]):
                index[r, start : start + n] = sample
                start += n
        batch["sample_index"] = index
        del batch["task_ids"]
        return batch
