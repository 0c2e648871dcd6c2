"""Continued pretraining's data: documents tokenised and joined with EOS into rows of `seq_length`
(`DocumentPacker`, also what a streamed corpus packs with: data_formats/streaming.py), attention kept
inside each document by the rows' `lengths`, through the token cache like every builder
(data_formats/datasets.py: splits, records, the cache); a weighted split packs each entry apart."""

from __future__ import annotations

import logging
from typing import Iterable

from tqdm.auto import tqdm

from data_formats.collate import IGNORE_INDEX
from data_formats.datasets import split_entries, split_records, through_cache
from data_formats.sources import file_entries
from data_formats.token_cache import Built, Check

log = logging.getLogger(__name__)


class DocumentPacker:
    """Packs documents (each followed by EOS) into rows of `seq_length`, a document continuing in
    the next row when it does not fit. Each row records its document pieces in `lengths`, so the
    collator keeps attention inside each document; the first token of every piece has label -100.
    Incremental (one document at a time) so a streamed corpus packs exactly as an in-memory one.
    Linear in the document's length: each token is copied once, into its row (a document of n
    tokens costs O(n), however many rows it fills). A row with no token to train on is not made.
    """

    def __init__(self, eos_id: int, seq_length: int):
        self.eos_id, self.seq_length = eos_id, seq_length
        self.current: list[int] = []
        self.lengths: list[int] = []

    def add(self, doc: Iterable[int]) -> list[dict]:
        """Add one document; return the rows it completed (possibly none)."""
        rows = []
        tokens = doc if isinstance(doc, list) else list(doc)
        start, total = 0, len(tokens) + 1  # the document, then its EOS
        while start < total:
            stop = min(start + self.seq_length - len(self.current), total)
            self.current += tokens[start : min(stop, len(tokens))]
            if stop == total:
                self.current.append(self.eos_id)
            self.lengths.append(stop - start)
            start = stop
            if len(self.current) == self.seq_length:
                rows += self._row()
        return rows

    def flush(self) -> list[dict]:
        """The last, shorter row (if any tokens are left and one of them is trained on)."""
        return self._row() if self.current else []

    def _row(self) -> list[dict]:
        """The finished row, or none when it trains nothing: every piece one token long (the row
        after a document that filled its own ends with that document's EOS alone, with nothing
        before it to predict it from), which would make a step of zero loss."""
        ids, lengths = self.current, self.lengths
        self.current, self.lengths = [], []
        if all(n == 1 for n in lengths):
            return []
        labels = list(ids)
        start = 0
        for n in lengths:
            labels[start] = IGNORE_INDEX
            start += n
        return [{"input_ids": ids, "labels": labels, "lengths": lengths, "task_ids": [0] * len(ids)}]


def chunk_documents(docs: Iterable[list[int]], eos_id: int, seq_length: int) -> list[dict]:
    """All packed rows of `docs` (see DocumentPacker; the last row may be shorter)."""
    packer = DocumentPacker(eos_id, seq_length)
    rows = [row for doc in docs for row in packer.add(doc)]
    return rows + packer.flush()


def build_pt_data(cfg, tokenizer, seq_length: int, split: str) -> list[dict]:
    """Packed PT rows (input_ids, labels, lengths, task_ids): documents joined with EOS, no
    attention across documents. Collate them with Collator(padding_mode='pack').

    Raises:
        DataError: bad records with on_error='strict'.
        ValueError: unknown split; the tokenizer has no eos token.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token to separate documents")
    built = through_cache(
        "pt",
        cfg,
        tokenizer,
        split,
        lambda check: _pt_rows(cfg, tokenizer, seq_length, split, check),
        seq_length=seq_length,
    )
    rows = built.samples
    log.info(
        "pt %s data: %d document(s), %d token(s), %d row(s) of %d",
        split,
        built.info["documents"],
        sum(len(r["input_ids"]) for r in rows),
        len(rows),
        seq_length,
    )
    return rows


def _pt_rows(cfg, tokenizer, seq_length: int, split: str, check: Check) -> Built:
    """build_pt_data's rows, with info {'documents'}. A weighted training split (cfg.weights)
    packs each entry's documents apart, each row marked with its entry's index (`entry`), so the mix
    draws rows of one source."""
    records = split_records(cfg, "pt", split, check, text_field=cfg.text_field)
    texts = [r.value for r in records]
    docs = []
    for start in tqdm(range(0, len(texts), 1000), desc=f"tokenizing pt {split}", disable=len(texts) < 1000):
        docs += tokenizer(texts[start : start + 1000], add_special_tokens=False)["input_ids"]
    if split != "train" or not getattr(cfg, "weights", None):
        return Built(chunk_documents(docs, tokenizer.eos_token_id, seq_length), {"documents": len(docs)})
    entries = split_entries(cfg, split)
    index = {entry: k for k, entry in enumerate(entries)}
    entry_of = file_entries(entries)
    rows = []
    for k in range(len(entries)):
        mine = [doc for doc, r in zip(docs, records) if index[entry_of.get(r.file, r.file)] == k]
        rows += [{**row, "entry": k} for row in chunk_documents(mine, tokenizer.eos_token_id, seq_length)]
    return Built(rows, {"documents": len(docs)})
