"""Streamed PT data (`data.streaming: true`): packed rows from a corpus read lazily, for corpora
that do not fit in memory.

Rows are exactly those `build_pt_data` would build from the same documents (the same
`DocumentPacker`), in corpus order: a streamed corpus is not shuffled, its order is the training
order. When the corpus runs out the stream starts over (the next epoch). Memory stays at one
document and the rows it fills, whatever the corpus size.

Why our own reader (data_formats.sources) rather than `datasets.load_dataset(..., streaming=True)`:
a bad record must be reported as FILE:LINE, which the datasets JSON reader cannot do, and resume
must be exact; with our reader the whole resume state is the number of records read this epoch
plus the unfinished row, which `state_dict` returns as plain JSON. Resuming re-reads (without
tokenizing) the records already consumed this epoch.

A weighted corpus (data.weights) is a `MixedTextStream`: one stream per entry, each packing its own
documents, and each row drawn from entry k with probability weights[k] by a seeded draw that is a
pure function of the row's number, so its resume state is the rows drawn plus each stream's own.
A streamed entry never ends (it starts over), so data.mix_stop does not apply to a stream.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from typing import Iterator, Optional, Sequence

import torch

from data_formats.pt_data import DocumentPacker
from data_formats.readers import MAX_RECORD_BYTES
from data_formats.sampling import DRAW_BLOCK, seed_of
from data_formats.sources import Problem
from data_formats.validate import apply_policy, entry_records, every_record_bad, iter_parsed

log = logging.getLogger(__name__)


def stream_problems(
    entries: Sequence[str], *, fmt: str = "auto", text_field: str = "text", max_record_bytes: int = MAX_RECORD_BYTES
) -> list[Problem]:
    """Every bad record of a corpus, read once without keeping it (the pre-training check), and a
    problem for each file with no good record at all (`every_record_bad`: data.on_error skip skips
    records, not whole files, streamed or not; a weighted entry of such files would yield nothing)."""
    problems, good = [], {}
    for item in iter_parsed(entry_records(entries, max_record_bytes), "pt", fmt=fmt, text_field=text_field):
        if isinstance(item, Problem):
            problems.append(item)
        else:
            good.setdefault(item.file, item)  # one per file: the check needs the files, not the documents
    return problems + every_record_bad(list(good.values()), problems)


class PackedTextStream:
    """An endless source of packed PT rows over `entries` (files, folders, globs, datasets).

    Bad records are dropped quietly when `on_error` is 'skip' (the pre-training check has already
    counted and logged them, once however many epochs re-read them) and raise DataError when 'strict'
    (the corpus changed since the check).
    """

    def __init__(
        self,
        entries: Sequence[str],
        tokenizer,
        seq_length: int,
        *,
        fmt: str = "auto",
        text_field: str = "text",
        on_error: str = "strict",
        max_record_bytes: int = MAX_RECORD_BYTES,
    ):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token to separate documents")
        self.entries, self.tokenizer = list(entries), tokenizer
        self.fmt, self.text_field, self.on_error = fmt, text_field, on_error
        self.max_record_bytes = max_record_bytes
        self.packer = DocumentPacker(tokenizer.eos_token_id, seq_length)
        self.epoch = 0
        self.records_read = 0
        self.ready: deque[dict] = deque()  # a long document fills many rows: popleft is O(1)
        self._items: Optional[Iterator] = None
        self._documents_this_epoch = 0

    def _open(self) -> Iterator:
        items = iter_parsed(
            entry_records(self.entries, self.max_record_bytes), "pt", fmt=self.fmt, text_field=self.text_field
        )
        return itertools.islice(items, self.records_read, None)

    def _next_document(self) -> Optional[list[int]]:
        """The next training document's token ids, or None at the end of the corpus."""
        if self._items is None:
            self._items = self._open()
        for item in self._items:
            self.records_read += 1
            if isinstance(item, Problem):
                apply_policy([item], self.on_error, "pt train data (streamed)", keep=False, said=True)  # checked
                continue
            self._documents_this_epoch += 1
            return self.tokenizer(item.value, add_special_tokens=False)["input_ids"]
        return None

    def next_row(self) -> dict:
        """The next packed row (dict of input_ids, labels, lengths, task_ids).

        Raises:
            DataError: a bad record with on_error='strict'.
            ValueError: the corpus holds no training document.
        """
        while not self.ready:
            doc = self._next_document()
            if doc is not None:
                self.ready += self.packer.add(doc)
                continue
            self.ready += self.packer.flush()
            if self._documents_this_epoch == 0 and not self.ready:
                raise ValueError(f"the streamed corpus {self.entries} holds no training document")
            self.epoch, self.records_read, self._items, self._documents_this_epoch = self.epoch + 1, 0, None, 0
            log.info("streamed pt data: starting epoch %d", self.epoch)
        return self.ready.popleft()

    def describe(self) -> dict:
        """What the manifest records of a mix: nothing, for one unweighted stream (`MixedTextStream`'s
        has the entries and their weights)."""
        return {}

    def state_dict(self) -> dict:
        """Where the stream stands (JSON-serialisable)."""
        return {
            "epoch": self.epoch,
            "records_read": self.records_read,
            "ready": list(self.ready),
            "current": self.packer.current,
            "lengths": self.packer.lengths,
            "documents_this_epoch": self._documents_this_epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken (re-reads, without tokenizing, the records
        already consumed this epoch)."""
        self.epoch, self.records_read = int(state["epoch"]), int(state["records_read"])
        self.ready = deque(dict(row) for row in state["ready"])
        self.packer.current, self.packer.lengths = list(state["current"]), list(state["lengths"])
        self._documents_this_epoch = int(state["documents_this_epoch"])
        self._items = None


class MixedTextStream:
    """Packed PT rows drawn by weight from one `PackedTextStream` per entry (module docstring)."""

    def __init__(
        self, entries: Sequence[str], weights: Sequence[float], seed: int, tokenizer, seq_length: int, **options
    ):
        if len(weights) != len(entries):
            raise ValueError(f"{len(weights)} weight(s) for {len(entries)} entr(ies)")
        self.names, self.weights = list(entries), [float(w) for w in weights]
        self.streams = [PackedTextStream([entry], tokenizer, seq_length, **options) for entry in entries]
        total = float(sum(weights))
        self.probs = torch.tensor([float(w) / total for w in weights], dtype=torch.float64)
        self.seed, self.rows = seed, 0
        self._block: tuple[int, list[int]] = (-1, [])

    def source_of(self, row: int) -> int:
        """The entry row number `row` is drawn from (a pure function of the seed and `row`)."""
        block = row // DRAW_BLOCK
        if self._block[0] != block:
            generator = torch.Generator().manual_seed(seed_of(self.seed, "stream", block))
            self._block = (
                block,
                torch.multinomial(self.probs, DRAW_BLOCK, replacement=True, generator=generator).tolist(),
            )
        return self._block[1][row % DRAW_BLOCK]

    def next_row(self) -> dict:
        """The next row, from the entry its draw names (see PackedTextStream.next_row for what it raises)."""
        k = self.source_of(self.rows)
        self.rows += 1
        return self.streams[k].next_row()

    def describe(self) -> dict:
        """What the manifest records (as `SourceMix.describe`): the entries and their weights, the
        rows drawn from each so far, and the seed; a stream never ends, so there is no stop."""
        drawn = torch.bincount(
            torch.tensor([self.source_of(row) for row in range(self.rows)], dtype=torch.long), minlength=len(self.names)
        ).tolist()
        return {
            "sources": [{"entry": n, "weight": w, "rows_drawn": d} for n, w, d in zip(self.names, self.weights, drawn)],
            "stop": "streamed (entries start over)",
            "seed": self.seed,
        }

    def state_dict(self) -> dict:
        return {"rows": self.rows, "streams": [stream.state_dict() for stream in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        self.rows = int(state["rows"])
        for stream, saved in zip(self.streams, state["streams"]):
            stream.load_state_dict(saved)


def open_stream(data, tokenizer, seq_length: int, seed: int):
    """The training stream of a PT data section: a `MixedTextStream` when it weighs its entries
    (data.weights), else one `PackedTextStream` over all of them."""
    options = dict(
        fmt=data.format, text_field=data.text_field, on_error=data.on_error, max_record_bytes=data.max_record_bytes
    )
    if data.weights:
        return MixedTextStream(data.train, data.weights, seed, tokenizer, seq_length, **options)
    return PackedTextStream(data.train, tokenizer, seq_length, **options)
