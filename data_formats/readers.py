"""Reading one data file (or a Hugging Face dataset's rows) into raw records that keep their
`FILE:LINE` (data_formats.sources reads the data path entries that name them).

Why JSON/JSONL are read line by line here rather than with `datasets.load_dataset("json")`: the
validator must name the file and line of every bad record, and the datasets JSON loader neither
reports line numbers nor keeps going after a bad line. Parquet files and hub datasets go through
`datasets`, and their "line" is the 1-based row number. Line 0 means the problem concerns the whole
file (missing, empty, unreadable, an unsupported kind of file).

Files are UTF-8; a leading byte-order mark is skipped and CRLF line ends are read like LF (what
Windows editors write). A record longer than `max_bytes` (default `MAX_RECORD_BYTES`, the data
section's `max_record_bytes`) is refused by its byte length, with its FILE:LINE, before it is
decoded or parsed: a JSONL line is measured while it is read and never kept, a .txt file by its
size, a Parquet or dataset row by its JSON text. A .json file is one JSON value, so it is read and
decoded whole and an over-long element of its array is refused after decoding but before any
rendering or tokenizing. A .json file whose first line is a whole JSON value (not an array) with
more text on the lines after it is JSON Lines (as `datasets` and LLaMA-Factory read it), and is read
as a .jsonl is.

A JSON string may spell an unpaired UTF-16 surrogate (`"\\ud800"`), which decodes to a Python str
that no tokenizer or UTF-8 writer accepts: such a record is refused here, naming the field.

Parquet files and datasets are columnar: every row has every column, Arrow filling the keys a row
lacks with null, in nested objects too (each message of a list gets every message key). So a null
field of a row is read as a key the row does not have (`_without_nulls`), and the row reads as the
JSON record it was made from; a null inside a list stays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
_TABLE_SUFFIXES = (".csv", ".tsv", ".arrow", ".feather", ".ndjson", ".jsonlines")
"""Other data files a folder may hold: Relay reads none of them, so a folder's are reported."""
_COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4", ".7z")
_NOT_DATA_NAMES = ("readme", "license", "licence", "copying", "notice")
"""A folder's files of these names (the part before the first dot, in any case), whatever their
suffix (README.txt, LICENSE.jsonl), are its documentation and licence, not data."""
MAX_RECORD_BYTES = 8 * 1024 * 1024
"""Default bound on one record's size in bytes (8 MiB, the data section's `max_record_bytes`):
far above any training sample (a 4k-token sample is ~16 KB), far below what a broken export
(a whole corpus on one line) costs to parse and render."""
_BOM = b"\xef\xbb\xbf"
_CHUNK = 1 << 20


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
    plain_text: bool = False
    """A .txt file's document: its text is the document whatever field `data.text_field` names."""


def _decode(data: bytes) -> tuple[Optional[str], Optional[str]]:
    """(text, None) or (None, reason) for one line's bytes."""
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as err:
        return None, f"undecodable bytes (not UTF-8) at byte {err.start}"


def too_long(size: int, max_bytes: int) -> str:
    """The reason a record of `size` bytes is refused."""
    return (
        f"record is {size:,} bytes, over the limit of {max_bytes:,} (data.max_record_bytes); "
        "not parsed (a whole file on one line?)"
    )


def _lines(path: Path, max_bytes: int) -> Iterator[tuple[int, Optional[bytes], int]]:
    """(line number, the line's bytes without its line end, size) per line; the bytes are None when
    the line is longer than `max_bytes`: such a line is read in chunks and never kept whole."""
    with path.open("rb") as f:
        number = 0
        while True:
            data = f.readline(max_bytes + 2)  # the bound, plus a CRLF line end
            if not data:
                return
            number += 1
            size = len(data)
            while not data.endswith(b"\n") and size > max_bytes:
                data = f.readline(_CHUNK)
                if not data:
                    break
                size += len(data)
            line_end = 2 if data.endswith(b"\r\n") else 1 if data.endswith(b"\n") else 0
            if size - line_end > max_bytes:
                yield number, None, size - line_end
                continue
            line = data[: len(data) - line_end]
            if number == 1 and line.startswith(_BOM):
                line = line[len(_BOM) :]
            yield number, line, len(line)


def _surrogate(value: Any, where: str = "") -> Optional[str]:
    """Why a decoded JSON value cannot be text (a string or key holding an unpaired surrogate, naming
    where it is: `messages[1].content`), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            code = ord(value[err.start])
            return f"{where or 'the record'} holds an unpaired surrogate \\u{code:04x} (not valid Unicode)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            reason = _surrogate(key, f"a key of {where or 'the record'}") or _surrogate(
                item, f"{where}.{key}" if where else key
            )
            if reason:
                return reason
    elif isinstance(value, list):
        for i, item in enumerate(value):
            reason = _surrogate(item, f"{where}[{i}]")
            if reason:
                return reason
    return None


def _record(path: Path, line: int, task: str, value: Any, raw: str) -> RawRecord:
    """The raw record of a decoded JSON value, or its problem when a string of it is not valid
    Unicode; only a `\\u` escape in the JSON text can make one, so text without one is not walked."""
    reason = _surrogate(value) if "\\u" in raw else None
    if reason is not None:
        return RawRecord(str(path), line, task, error=reason)
    return RawRecord(str(path), line, task, record=value, raw=raw)


def _read_jsonl(path: Path, task: str, max_bytes: int) -> Iterator[RawRecord]:
    for number, data, size in _lines(path, max_bytes):
        if data is None:
            yield RawRecord(str(path), number, task, error=too_long(size, max_bytes))
            continue
        text, error = _decode(data)
        if error is None and not text.strip():
            error = "blank line"
        if error is not None:
            yield RawRecord(str(path), number, task, error=error)
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            yield RawRecord(str(path), number, task, error=f"invalid JSON: {err.msg} (column {err.colno})")
            continue
        yield _record(path, number, task, value, text)


def _decoded(path: Path, task: str):
    """The file's text (a leading byte-order mark removed); when it is not UTF-8, yields the problem
    record (with the line of the first bad byte) and returns None. Use as
    `text = yield from _decoded(path, task)`."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        yield RawRecord(str(path), data.count(b"\n", 0, err.start) + 1, task, error="undecodable bytes (not UTF-8)")
        return None


def _utf8_size(text: str, max_bytes: int) -> int:
    """len(text.encode()), computed only when it could exceed `max_bytes` (else len(text))."""
    return len(text.encode("utf-8")) if 4 * len(text) > max_bytes else len(text)


_JSON_SPACE = " \t\r\n"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _JSON_SPACE:
        pos += 1
    return pos


def _syntax_error(path: Path, task: str, text: str, pos: int, what: str, after: str = "") -> RawRecord:
    """The problem record of a JSON syntax error at `pos` of `text`: `what`, its line and column,
    then `after`."""
    err = json.JSONDecodeError(what, text, pos)
    return RawRecord(str(path), err.lineno, task, error=f"invalid JSON: {err.msg} (column {err.colno}){after}")


def _after_array(path: Path, task: str, text: str, pos: int) -> Iterator[RawRecord]:
    """The problem of text after the array's closing ']' at `pos` (nothing when only space follows)."""
    after = _skip_space(text, pos + 1)
    if after < len(text):
        yield _syntax_error(path, task, text, after, "text after the array's closing ']'")


def _is_json_lines(path: Path, max_bytes: int) -> bool:
    """Whether a .json file is JSON Lines: its first line is one whole JSON value that is no array,
    and more than space follows it. Reads only the file's start."""
    with path.open("rb") as f:
        first = f.readline(max_bytes + 2).removeprefix(_BOM)
        try:
            value = json.loads(first.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return False
        if not first.endswith(b"\n") or isinstance(value, list):
            return False
        while chunk := f.read(_CHUNK):
            if chunk.strip():
                return True
    return False


def _read_json(path: Path, task: str, max_bytes: int) -> Iterator[RawRecord]:
    """A JSON file holding one array of records (or one record). Each array element is decoded on
    its own with raw_decode so that its line number is known; the array's own syntax (commas
    between elements, its closing bracket, nothing after it) is checked as json.loads checks it.
    The elements before a syntax error are yielded, then the error, and the rest of the file is
    not read. A file of whitespace alone, or holding an empty array, is an empty file. A file of
    one value per line (`_is_json_lines`) is read as JSON Lines, each line's problem its own."""
    if _is_json_lines(path, max_bytes):
        yield from _read_jsonl(path, task, max_bytes)
        return
    text = yield from _decoded(path, task)
    if text is None:
        return
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if pos == len(text):
        yield RawRecord(str(path), 0, task, error="empty file (whitespace only)")
        return
    if not text.startswith("[", pos):
        line = text.count("\n", 0, pos) + 1
        if _utf8_size(text, max_bytes) > max_bytes:
            yield RawRecord(str(path), line, task, error=too_long(len(text.encode("utf-8")), max_bytes))
            return
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            yield RawRecord(str(path), err.lineno, task, error=f"invalid JSON: {err.msg} (column {err.colno})")
            return
        yield _record(path, line, task, value, text)
        return
    pos = _skip_space(text, pos + 1)
    if text.startswith("]", pos):
        trailing = list(_after_array(path, task, text, pos))
        yield from trailing or [RawRecord(str(path), 0, task, error="empty file (an empty JSON array: no records)")]
        return
    while True:
        if pos >= len(text):
            end = len(text.rstrip(_JSON_SPACE))
            yield _syntax_error(
                path, task, text, end, "the array has no closing ']'", "; the file ends there (cut off?)"
            )
            return
        line = text.count("\n", 0, pos) + 1
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            yield RawRecord(
                str(path),
                err.lineno,
                task,
                error=f"invalid JSON: {err.msg} (column {err.colno}); rest of file not read",
            )
            return
        size = _utf8_size(text[pos:end], max_bytes)
        if size > max_bytes:
            yield RawRecord(str(path), line, task, error=too_long(size, max_bytes))
        else:
            yield _record(path, line, task, value, text[pos:end])
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif text.startswith("]", pos):
            yield from _after_array(path, task, text, pos)
            return
        elif pos < len(text):
            yield _syntax_error(path, task, text, pos, "Expecting ',' delimiter", "; rest of file not read")
            return


def _read_txt(path: Path, task: str, max_bytes: int) -> Iterator[RawRecord]:
    """A .txt file is one document (PT), its CRLF line ends read as LF; a blank file is a problem."""
    size = path.stat().st_size
    if size > max_bytes:
        yield RawRecord(str(path), 1, task, error=too_long(size, max_bytes))
        return
    text = yield from _decoded(path, task)
    if text is None:
        return
    text = text.replace("\r\n", "\n")
    yield RawRecord(str(path), 1, task, record={"text": text}, raw=text, plain_text=True)


def _without_nulls(value: Any) -> Any:
    """A columnar row as the JSON record it was made from: every null field of it, and of the
    objects nested in it, left out (Arrow fills the keys a record lacks with null); a null element
    of a list is kept."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _read_rows(rows, name: str, task: str, max_bytes: int) -> Iterator[RawRecord]:
    """The records of a Parquet file's or a dataset's rows (strings from Arrow are valid UTF-8,
    so no surrogate check); a row's null fields are keys it lacks (`_without_nulls`)."""
    for number, row in enumerate(rows, start=1):
        raw = json.dumps(row, sort_keys=True, default=str)
        size = _utf8_size(raw, max_bytes)
        if size > max_bytes:
            yield RawRecord(name, number, task, error=too_long(size, max_bytes))
            continue
        yield RawRecord(name, number, task, record=_without_nulls(dict(row)), raw=raw)


def _read_parquet(path: Path, task: str, max_bytes: int) -> Iterator[RawRecord]:
    """The rows of a Parquet file; one that cannot be read (corrupt, cut off, not Parquet) is one
    problem at line 0."""
    import datasets

    try:
        rows = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except (ValueError, OSError, NotImplementedError, datasets.exceptions.DatasetGenerationError) as err:
        # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors, an unsupported codec or
        # encoding a NotImplementedError; datasets wraps one raised while it reads the pages
        yield RawRecord(str(path), 0, task, error=f"cannot read parquet: {err.__cause__ or err}")
        return
    yield from _read_rows(rows, str(path), task, max_bytes)


def _data_suffix(path: Path) -> str:
    """The suffix that says what data a file holds, lower-cased: a compressed file's inner one
    (`.jsonl` of `a.jsonl.gz`), else its own."""
    suffix = path.suffix.lower()
    if suffix in _COMPRESSED_SUFFIXES:
        return Path(path.stem).suffix.lower()
    return suffix


def looks_like_data(path: Path) -> bool:
    """Whether a file in a folder entry is read as data: a supported suffix, the same in another
    case, or another data table's (CSV, TSV, Arrow), compressed or not; `read_file` reports all
    but the first. Other files (a script, a task YAML, a hidden file such as `.DS_Store`) are not
    data and are passed over, and so is a README or a licence (`_NOT_DATA_NAMES`) of any suffix."""
    if path.name.split(".")[0].lower() in _NOT_DATA_NAMES:
        return False
    if path.suffix in SUFFIXES:
        return True
    return not path.name.startswith(".") and _data_suffix(path) in (*SUFFIXES, *_TABLE_SUFFIXES)


def unsupported(path: Path) -> Optional[str]:
    """Why a file's kind cannot be read (its suffix), or None when it can."""
    if path.suffix in SUFFIXES:
        return None
    use = f"use {', '.join(SUFFIXES)} (JSON Lines, a JSON array, Parquet, plain text)"
    inner = _data_suffix(path)
    if path.suffix.lower() in _COMPRESSED_SUFFIXES and inner in SUFFIXES:
        return f"compressed {inner}{path.suffix} files are not supported: decompress it to a {inner} file"
    if path.suffix.lower() in _COMPRESSED_SUFFIXES and inner:
        return f"compressed {inner}{path.suffix} files are not supported; {use}"
    if path.suffix.lower() in SUFFIXES:
        return (
            f"{path.suffix} files are not supported (suffixes are case-sensitive): rename it to {path.suffix.lower()}"
        )
    kind = f"{path.suffix} files are" if path.suffix else "a file without a suffix is"
    return f"{kind} not supported; {use}"


def read_file(path: Path, task: str, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[RawRecord]:
    """Raw records of one file, in order; unreadable pieces come back with `error` set, and so
    does every record over `max_bytes` (see the module docstring)."""
    if not path.is_file():
        yield RawRecord(str(path), 0, task, error="no such file")
        return
    if unsupported(path):
        yield RawRecord(str(path), 0, task, error=unsupported(path))
        return
    if path.stat().st_size == 0:
        yield RawRecord(str(path), 0, task, error="empty file")
        return
    if path.suffix == ".parquet":
        yield from _read_parquet(path, task, max_bytes)
    elif path.suffix == ".json":
        yield from _read_json(path, task, max_bytes)
    elif path.suffix == ".txt":
        yield from _read_txt(path, task, max_bytes)
    else:
        yield from _read_jsonl(path, task, max_bytes)


def read_dataset(name: str, task: str, max_bytes: int) -> Iterator[RawRecord]:
    """A Hugging Face dataset by name (`name` or `name:split`, default split 'train')."""
    import datasets

    repo, _, split = name.partition(":")
    try:
        rows = datasets.load_dataset(repo, split=split or "train")
    except Exception as err:  # datasets raises many types for "not found / offline"
        yield RawRecord(
            name, 0, task, error=f"no such file or folder, and not a loadable dataset: {type(err).__name__}: {err}"
        )
        return
    yield from _read_rows(rows, name, task, max_bytes)
