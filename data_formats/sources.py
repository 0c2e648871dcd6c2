"""Reading data path entries (files, folders, globs, Hugging Face dataset names, LLaMA-Factory
registry entries) into raw records that keep their `FILE:LINE`, and reporting the problems found
(`Problem`, `summarize`, `DataError`). Each file is read by data_formats.readers (the module says how
JSON, JSON Lines, Parquet and text files are read, and what is refused there).

Line 0 means the problem concerns the whole file (missing, empty, unreadable, an unsupported
kind of file).
"""

from __future__ import annotations

import glob as globlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from data_formats import llamafactory_registry
from data_formats.conversation import RecordError
from data_formats.readers import MAX_RECORD_BYTES, SUFFIXES, RawRecord, looks_like_data, read_dataset, read_file

_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Problem:
    """One bad record (or file): printed as `FILE:LINE: reason`."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


def _line_ranges(lines: list[int], shown: int = 6) -> str:
    """'1-200' or '3, 7, 9-12' (the first `shown` runs, then '...')."""
    runs: list[list[int]] = []
    for line in sorted(set(lines)):
        if runs and line == runs[-1][1] + 1:
            runs[-1][1] = line
        else:
            runs.append([line, line])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:shown])
    return text + (", ..." if len(runs) > shown else "")


def summarize(problems: Iterable[Problem]) -> list[str]:
    """The lines that report `problems`: one per distinct (file, reason), in order of first
    appearance; `FILE:LINE: reason` for one record, `FILE:LINE: N records: reason (lines ...)` when
    several records of a file share the reason (a file of another kind's data gives one line, not
    one per record)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for p in problems:
        groups.setdefault((p.file, p.reason), []).append(p.line)
    out = []
    for (file, reason), lines in groups.items():
        if len(lines) == 1:
            out.append(f"{file}:{lines[0]}: {reason}")
        else:
            out.append(f"{file}:{min(lines)}: {len(lines)} records: {reason} (lines {_line_ranges(lines)})")
    return out


class DataError(ValueError):
    """Data problems found before training; `problems` lists every one, the message summarizes
    them (see `summarize`: one line per distinct reason in a file)."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  {line}" for line in summarize(self.problems))
        super().__init__(f"{len(self.problems)} data problem(s) (fix them, or set data.on_error=skip):\n{lines}")


def entry_task_name(entry: str) -> str:
    """Task name of a data path entry: a file's stem, a folder's name, a glob's folder name, or
    the last part of a dataset name; a LLaMA-Factory registry entry's dataset name."""
    registry = llamafactory_registry.split_entry(entry)
    if registry is not None:
        return registry[1]
    if any(c in entry for c in _GLOB_CHARS):
        return Path(entry.split("*")[0].split("?")[0].split("[")[0]).name or Path(entry).parent.name
    path = Path(entry)
    if path.is_file():
        return path.stem
    return path.name or entry.rstrip("/").split("/")[-1]


def expand_entry(entry: str) -> tuple[list[Path], Optional[str]]:
    """The files a data path entry names, or ([], dataset name) when it is not a local path.

    Folders expand to their files that hold data (`looks_like_data`: the supported ones, and the
    data files Relay cannot read, which `read_file` then reports), globs to every file they match
    (an unsupported one is reported the same way), sorted, so the order is reproducible. A LLaMA-Factory
    registry entry (`FOLDER/dataset_info.json:NAME`) names the registry and its entry's files (a
    change to either is a change of the data), or its hub dataset.
    """
    registry = llamafactory_registry.split_entry(entry)
    if registry is not None:
        return _registry_files(entry, registry[0])
    if any(c in entry for c in _GLOB_CHARS):
        return sorted(Path(p) for p in globlib.glob(entry, recursive=True) if Path(p).is_file()), None
    path = Path(entry)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and looks_like_data(p)), None
    if path.exists() or path.suffix in SUFFIXES or entry.startswith((".", "/")):
        return [path], None
    return [], entry


def file_entries(entries: Iterable[str]) -> dict[str, str]:
    """{file as a record names it: the data entry that reads it}, the first entry where two name
    the same file; a dataset's records name the dataset, so it maps to itself."""
    out: dict[str, str] = {}
    for entry in entries:
        files, dataset = expand_entry(entry)
        for name in [dataset] if dataset is not None else map(str, files):
            out.setdefault(name, entry)
    return out


def _registry_files(entry: str, registry: Path) -> tuple[list[Path], Optional[str]]:
    try:
        found = llamafactory_registry.resolve(entry)
    except llamafactory_registry.RegistryError:
        return [registry], None  # validation reports the entry's problem in one line
    if found.hub is not None:
        return [], found.hub
    files, _ = expand_entry(str(found.data))
    return [registry, *files], None


def read_entry(entry: str, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[RawRecord]:
    """Raw records of one data path entry (file, folder, glob or dataset name)."""
    if llamafactory_registry.split_entry(entry) is not None:
        yield from _read_registry_entry(entry, max_bytes)
        return
    task = entry_task_name(entry)
    files, dataset = expand_entry(entry)
    if dataset is not None:
        yield from read_dataset(dataset, task, max_bytes)
        return
    if not files:
        yield RawRecord(entry, 0, task, error="no files match")
    for path in files:
        yield from read_file(path, task, max_bytes)


def _read_registry_entry(entry: str, max_bytes: int) -> Iterator[RawRecord]:
    """The records of a LLaMA-Factory registry entry, each rewritten by the entry's columns and tags
    (data_formats.llamafactory_registry), with the FILE:LINE of the file it came from; the
    task is the entry's dataset name."""
    name = entry.rpartition(":")[2]
    try:
        spec = llamafactory_registry.resolve(entry)
    except llamafactory_registry.RegistryError as err:
        yield RawRecord(entry, 0, name, error=str(err).removeprefix(f"{entry}: "))
        return
    raws = read_dataset(spec.hub, name, max_bytes) if spec.hub is not None else read_entry(str(spec.data), max_bytes)
    for raw in raws:
        if raw.error is not None:
            yield RawRecord(raw.file, raw.line, name, error=raw.error)
            continue
        try:
            yield RawRecord(
                raw.file, raw.line, name, record=llamafactory_registry.convert(raw.record, spec), raw=raw.raw
            )
        except RecordError as err:
            yield RawRecord(raw.file, raw.line, name, error=str(err))
