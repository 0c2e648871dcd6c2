"""Reading data path entries (files, folders, globs, Hugging Face dataset names) into raw records
that keep their `FILE:LINE`.

Why JSON/JSONL are read line by line here rather than with `datasets.load_dataset("json")`: the
validator must name the file and line of every bad record, and the datasets JSON loader neither
reports line numbers nor keeps going after a bad line. Parquet files and hub datasets go through
`datasets`, and their "line" is the 1-based row number.

Line 0 means the problem concerns the whole file (missing, empty, unreadable).
"""

from __future__ import annotations

import glob as globlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Problem:
    """One bad record (or file): printed as `FILE:LINE: reason`."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


class DataError(ValueError):
    """Data problems found before training; `problems` lists every one, and so does the message."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} data problem(s) (fix them, or set data.on_error=skip):\n{lines}")


@dataclass
class RawRecord:
    """A record as read: `record` is the decoded JSON value (or {'text': ...} for .txt files);
    `error` is set instead when the line could not be decoded."""

    file: str
    line: int
    task: str
    """The data path entry's name (file stem, folder name, or dataset name)."""
    record: Any = None
    error: Optional[str] = None
    raw: str = ""
    """The record's source text, used to carve a deterministic eval split."""


def entry_task_name(entry: str) -> str:
    """Task name of a data path entry: a file's stem, a folder's name, a glob's folder name, or
    the last part of a dataset name."""
    if any(c in entry for c in _GLOB_CHARS):
        return Path(entry.split("*")[0].split("?")[0].split("[")[0]).name or Path(entry).parent.name
    path = Path(entry)
    if path.is_file():
        return path.stem
    return path.name or entry.rstrip("/").split("/")[-1]


def expand_entry(entry: str) -> tuple[list[Path], Optional[str]]:
    """The files a data path entry names, or ([], dataset name) when it is not a local path.

    Globs and folders expand to their supported files, sorted, so the order is reproducible.
    """
    if any(c in entry for c in _GLOB_CHARS):
        return sorted(Path(p) for p in globlib.glob(entry, recursive=True) if Path(p).is_file()), None
    path = Path(entry)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES), None
    if path.exists() or path.suffix in SUFFIXES or entry.startswith((".", "/")):
        return [path], None
    return [], entry


def _decode(data: bytes) -> tuple[Optional[str], Optional[str]]:
    """(text, None) or (None, reason) for one line's bytes."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as err:
        return None, f"undecodable bytes (not UTF-8) at byte {err.start}"


def _read_jsonl(path: Path, task: str) -> Iterator[RawRecord]:
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for number, data in enumerate(lines, start=1):
        text, error = _decode(data.rstrip(b"\r"))
        if error is None and not text.strip():
            error = "blank line"
        if error is not None:
            yield RawRecord(str(path), number, task, error=error)
            continue
        try:
            yield RawRecord(str(path), number, task, record=json.loads(text), raw=text)
        except json.JSONDecodeError as err:
            yield RawRecord(str(path), number, task, error=f"invalid JSON: {err.msg} (column {err.colno})")


def _decoded(path: Path, task: str):
    """The file's text; when it is not UTF-8, yields the problem record (with the line of the first
    bad byte) and returns None. Use as `text = yield from _decoded(path, task)`."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        yield RawRecord(str(path), data.count(b"\n", 0, err.start) + 1, task, error="undecodable bytes (not UTF-8)")
        return None


def _read_json(path: Path, task: str) -> Iterator[RawRecord]:
    """A JSON file holding one array of records (or one record). Each array element is decoded on
    its own with raw_decode so that its line number is known."""
    text = yield from _decoded(path, task)
    if text is None:
        return
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        try:
            yield RawRecord(str(path), text.count("\n", 0, pos) + 1, task, record=json.loads(text), raw=text)
        except json.JSONDecodeError as err:
            yield RawRecord(str(path), err.lineno, task, error=f"invalid JSON: {err.msg} (column {err.colno})")
        return
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        line = text.count("\n", 0, pos) + 1
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            yield RawRecord(str(path), err.lineno, task, error=f"invalid JSON: {err.msg} (column {err.colno}); rest of file not read")
            return
        yield RawRecord(str(path), line, task, record=value, raw=text[pos:end])
        pos = end


def _read_txt(path: Path, task: str) -> Iterator[RawRecord]:
    """A .txt file is one document (PT); a blank file is a problem."""
    text = yield from _decoded(path, task)
    if text is None:
        return
    yield RawRecord(str(path), 1, task, record={"text": text}, raw=text)


def _read_rows(rows, name: str, task: str) -> Iterator[RawRecord]:
    for number, row in enumerate(rows, start=1):
        yield RawRecord(name, number, task, record=dict(row), raw=json.dumps(row, sort_keys=True, default=str))


def read_file(path: Path, task: str) -> Iterator[RawRecord]:
    """Raw records of one file, in order; unreadable pieces come back with `error` set."""
    if not path.is_file():
        yield RawRecord(str(path), 0, task, error="no such file")
        return
    if path.stat().st_size == 0:
        yield RawRecord(str(path), 0, task, error="empty file")
        return
    if path.suffix == ".parquet":
        import datasets

        yield from _read_rows(datasets.load_dataset("parquet", data_files=str(path), split="train"), str(path), task)
    elif path.suffix == ".json":
        yield from _read_json(path, task)
    elif path.suffix == ".txt":
        yield from _read_txt(path, task)
    else:
        yield from _read_jsonl(path, task)


def read_entry(entry: str) -> Iterator[RawRecord]:
    """Raw records of one data path entry (file, folder, glob or dataset name)."""
    task = entry_task_name(entry)
    files, dataset = expand_entry(entry)
    if dataset is not None:
        yield from _read_dataset(dataset, task)
        return
    if not files:
        yield RawRecord(entry, 0, task, error="no files match")
    for path in files:
        yield from read_file(path, task)


def _read_dataset(name: str, task: str) -> Iterator[RawRecord]:
    """A Hugging Face dataset by name (`name` or `name:split`, default split 'train')."""
    import datasets

    repo, _, split = name.partition(":")
    try:
        rows = datasets.load_dataset(repo, split=split or "train")
    except Exception as err:  # datasets raises many types for "not found / offline"
        yield RawRecord(name, 0, task, error=f"no such file or folder, and not a loadable dataset: {type(err).__name__}: {err}")
        return
    yield from _read_rows(rows, name, task)
