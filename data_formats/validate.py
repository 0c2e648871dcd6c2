"""Check every record before training; print `FILE:LINE: reason` for each problem.

    python -m data_formats.validate --kind sft data/sft/*.jsonl
    python -m data_formats.validate --kind sft --model embedded --seq-length 512 data/sft/

Exit status 1 when any problem is found, 0 otherwise; the last line gives the counts. Stages run
the same checks (`parse_records`) at start-up: `on_error=strict` raises one DataError listing every
problem, `on_error=skip` drops exactly those records and logs them once, grouped by reason with
their lines (`apply_policy`; the stage writes the same summary to its run folder and counts it in
the manifest); a file with no good record stays an error (`every_record_bad`).

With `--seq-length`, samples longer than that (in tokens, rendered with `--template`) are reported
too, since the stage would drop them (truncation=drop) or could not keep any supervised token.
Records over `--max-record-bytes` (the data section's `max_record_bytes`) are refused unread.
Problems that repeat in a file print once with their count (data_formats.sources.summarize), and
every file's detected format is printed, so data of the wrong kind shows up as one line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

from data_formats import llamafactory_registry
from data_formats.conversation import RecordError, task_of
from data_formats.formats import KIND_NAMES, KINDS, NAMES, UNPAIRED, detect_format, format_problem, hint, kind_formats
from data_formats.readers import MAX_RECORD_BYTES, RawRecord
from data_formats.records import (
    margin_of,
    parse_conversation,
    parse_preference,
    parse_prompt,
    parse_text,
    parse_unpaired,
)
from data_formats.render import make_template, render, render_prompt
from data_formats.sources import DataError, Problem, expand_entry, read_entry, summarize

log = logging.getLogger(__name__)


@dataclass
class Parsed:
    """A record that passed validation, with where it came from."""

    file: str
    line: int
    task: str
    raw: str
    value: Any
    """Conversation (sft, prompts), (chosen, rejected) Conversations plus margin (rm), str (pt),
    [(Conversation, desirable)] (kto)."""

    @property
    def source(self) -> str:
        return f"{self.file}:{self.line}"


def parse_record(
    raw: RawRecord,
    kind: str,
    fmt: str,
    *,
    text_field: str = "text",
    system_prompt: Optional[str] = None,
    margin_field: Optional[str] = None,
) -> Any:
    """The parsed value of one record for `kind` (see `Parsed.value`).

    Raises:
        RecordError: the record is bad; the message is the reason.
    """
    source = f"{raw.file}:{raw.line}"
    if kind == "pt":
        return parse_text(raw.record, "text" if raw.plain_text else text_field)
    if kind == "rm":
        chosen, rejected = parse_preference(raw.record, task=raw.task, source=source, system_prompt=system_prompt)
        return chosen, rejected, margin_of(raw.record, margin_field)
    if kind == "prompts":
        return parse_prompt(raw.record, fmt, task=raw.task, source=source, system_prompt=system_prompt)
    if kind == "kto":
        return parse_unpaired(raw.record, task=raw.task, source=source, system_prompt=system_prompt)
    return parse_conversation(
        raw.record, fmt, last="assistant", task=raw.task, source=source, system_prompt=system_prompt
    )


def _file_format(raw: RawRecord, kind: str, fmt: str) -> str:
    """The format of the record's file: the configured one, or detected from this record."""
    if fmt != "auto":
        return fmt
    if kind == "pt":
        return "text"
    if kind == "kto":  # a KTO record's layout is told apart by its label (data_formats.records.parse_unpaired)
        return UNPAIRED
    found = detect_format(raw.record)
    if found not in kind_formats(kind):
        what, advice = hint(found)
        raise RecordError(f"looks like {what}, not {KIND_NAMES[kind]} ({', '.join(kind_formats(kind))}): {advice}")
    return found


def iter_parsed(
    records: Iterable[RawRecord],
    kind: str,
    *,
    fmt: str = "auto",
    text_field: str = "text",
    system_prompt: Optional[str] = None,
    margin_field: Optional[str] = None,
    formats: Optional[dict[str, str]] = None,
) -> Iterator[Parsed | Problem]:
    """Validate raw records lazily: one Parsed (good) or Problem (bad record or file) per record.

    The format is detected once per file, from its first record that matches a known format;
    `formats`, when given, receives each file's format (file -> format).

    Raises:
        ValueError: unknown `kind` or `fmt`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if (problem := format_problem(fmt, kind)) is not None:  # a format of another kind would be ignored
        raise ValueError(problem)
    formats = {} if formats is None else formats
    for raw in records:
        if raw.error is not None:
            yield Problem(raw.file, raw.line, raw.error)
            continue
        try:
            if raw.file not in formats:
                formats[raw.file] = _file_format(raw, kind, fmt)
            value = parse_record(
                raw,
                kind,
                formats[raw.file],
                text_field=text_field,
                system_prompt=system_prompt,
                margin_field=margin_field,
            )
            task = task_of(raw.record, raw.task)
        except RecordError as err:
            yield Problem(raw.file, raw.line, str(err))
            continue
        yield Parsed(raw.file, raw.line, task, raw.raw, value)


def parse_records(records: Iterable[RawRecord], kind: str, **kwargs) -> tuple[list[Parsed], list[Problem]]:
    """`iter_parsed` collected: (good records, one Problem per bad record or file).

    Raises:
        ValueError: unknown `kind` or `fmt`.
    """
    good: list[Parsed] = []
    problems: list[Problem] = []
    for item in iter_parsed(records, kind, **kwargs):
        (problems if isinstance(item, Problem) else good).append(item)
    return good, problems


def data_problems(entries: Sequence[str], key: str) -> list[str]:
    """Data path entries that name no file (a missing path or an empty folder/glob), and LLaMA-Factory
    registry entries Relay cannot honour (data_formats.llamafactory_registry)."""

    out = []
    for entry in entries:
        refused = llamafactory_registry.problem(entry)
        if refused is not None:
            out.append(f"{key}: {refused}")
            continue
        files, dataset = expand_entry(entry)
        if dataset is None and (not files or not all(f.is_file() for f in files)):
            out.append(f"{key}: {entry!r} names no data file")
    return out


def entry_records(entries: Iterable[str], max_bytes: int = MAX_RECORD_BYTES) -> Iterator[RawRecord]:
    """Every raw record of every data path entry, in order (records over `max_bytes` unread)."""
    for entry in entries:
        yield from read_entry(entry, max_bytes)


def read_and_parse(
    entries: Iterable[str], kind: str, *, max_record_bytes: int = MAX_RECORD_BYTES, **kwargs
) -> tuple[list[Parsed], list[Problem]]:
    """`parse_records` over every record of every data path entry."""
    return parse_records(entry_records(entries, max_record_bytes), kind, **kwargs)


EVERY_RECORD_BAD = "every record of this file is bad"
_skipped: list[tuple[str, list[Problem]]] = []
"""What `apply_policy` skipped since the last `take_skipped` ((what, problems) per call): the stage
writes it to its run folder and counts it in the manifest."""


def every_record_bad(good: list[Parsed], problems: list[Problem]) -> list[Problem]:
    """One problem per file that has problems and no good record: skipping its records would
    silently train on none of it, so on_error=skip does not skip a whole file."""
    kept = {item.file for item in good}
    counts = Counter(p.file for p in problems if p.file not in kept)
    return [
        Problem(
            file,
            0,
            f"{EVERY_RECORD_BAD} ({n} problem(s)); data.on_error=skip skips bad records, not whole "
            "files: fix the file or take it out of the data paths",
        )
        for file, n in counts.items()
    ]


def take_skipped() -> list[tuple[str, list[Problem]]]:
    """What was skipped since the last call (see `_skipped`), emptying the record."""
    out = list(_skipped)
    _skipped.clear()
    return out


def skip_report(skipped: list[tuple[str, list[Problem]]]) -> tuple[list[str], dict, list[str]]:
    """(report lines, manifest entry, whole-file problem lines) of what `take_skipped` returned.
    The report is one grouped summary per data split; the manifest entry counts the records left
    out per split and reason."""
    lines, entry, fatal = [], {"count": 0, "by_split": {}}, []
    for what, problems in skipped:
        records = [p for p in problems if not p.reason.startswith(EVERY_RECORD_BAD)]
        fatal += [str(p) for p in problems if p.reason.startswith(EVERY_RECORD_BAD)]
        if not records:
            continue
        entry["count"] += len(records)
        entry["by_split"][what] = dict(Counter(p.reason for p in records).most_common())
        lines += [f"{what}: {len(records)} record(s) skipped (data.on_error=skip)"] + [
            f"  {s}" for s in summarize(records)
        ]
    return lines, entry, fatal


def apply_policy(
    problems: list[Problem], on_error: str, what: str = "data", keep: bool = True, said: bool = False
) -> None:
    """strict: raise DataError listing every problem; skip: log one grouped summary (reason, count,
    first lines) of the records left out (unless `said`: a check before already logged them) and, with
    `keep`, keep it for the run's report (`take_skipped`). A whole-file problem (`every_record_bad`) is
    kept too; the stage reports it as an error.

    Raises:
        DataError: `on_error` is 'strict' and there is at least one problem.
        ValueError: unknown `on_error`.
    """
    if on_error not in ("strict", "skip"):
        raise ValueError(f"on_error must be 'strict' or 'skip', got {on_error!r}")
    if not problems:
        return
    if on_error == "strict":
        raise DataError(problems)
    records = [p for p in problems if not p.reason.startswith(EVERY_RECORD_BAD)]
    if not said:
        log.warning("%s: skipping %d bad record(s) (data.on_error=skip):", what, len(records))
        for line in summarize(records):
            log.warning("skipped %s", line)
    if keep:
        _skipped.append((what, list(problems)))


def _overlong(good: list[Parsed], kind: str, args) -> list[Problem]:
    """Samples longer than --seq-length once rendered (needs --model)."""
    from pipeline.config import ChatDataConfig
    from pipeline.modeling.embedded import resolve_model_path
    from pipeline.modeling.models import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(args.model))
    template = make_template(ChatDataConfig(template=args.template), tokenizer)
    out = []
    for item in good:
        if kind == "pt":
            n = len(tokenizer(item.value, add_special_tokens=False)["input_ids"])
        elif kind == "rm":
            n = max(len(render(conv, tokenizer, template)[0]) for conv in item.value[:2])
        elif kind == "prompts":
            n = len(render_prompt(item.value, tokenizer, template))
        elif kind == "kto":
            n = max(len(render(conv, tokenizer, template)[0]) for conv, _ in item.value)
        else:
            n = len(render(item.value, tokenizer, template)[0])
        if n > args.seq_length and kind != "pt":
            out.append(Problem(item.file, item.line, f"overlong: {n} tokens > seq_length {args.seq_length}"))
    return out


def format_lines(
    good: list[Parsed], problems: list[Problem], formats: dict[str, str], detected: bool = True
) -> list[str]:
    """One line per file read: its format (detected or given) and its good and bad record counts."""
    counts: dict[str, list[int]] = {}
    for item in good:
        counts.setdefault(item.file, [0, 0])[0] += 1
    for problem in problems:
        counts.setdefault(problem.file, [0, 0])[1] += 1
    how = "detected" if detected else "given"
    out = []
    for file, (n_good, n_bad) in sorted(counts.items()):
        fmt = f"format '{formats[file]}' ({how})" if file in formats else "no usable format"
        out.append(f"{file}: {fmt}, {n_good} good record(s), {n_bad} problem(s)")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """The validate command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m data_formats.validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="files, folders, globs or dataset names")
    parser.add_argument("--kind", choices=KINDS, default="sft")
    parser.add_argument("--format", default="auto", choices=("auto",) + NAMES)
    parser.add_argument("--text-field", default="text", help="document field for --kind pt")
    parser.add_argument("--seq-length", type=int, default=None, help="also report samples longer than this")
    parser.add_argument("--model", default="embedded", help="tokenizer for --seq-length")
    parser.add_argument("--template", default="chat_template", choices=("chat_template", "role_markers"))
    parser.add_argument(
        "--max-record-bytes",
        type=int,
        default=MAX_RECORD_BYTES,
        help="refuse records longer than this, unread (data.max_record_bytes)",
    )
    args = parser.parse_args(argv)
    if (problem := format_problem(args.format, args.kind)) is not None:
        parser.error(problem)
    formats: dict[str, str] = {}
    good, problems = read_and_parse(
        args.files,
        args.kind,
        fmt=args.format,
        text_field=args.text_field,
        max_record_bytes=args.max_record_bytes,
        formats=formats,
    )
    if args.seq_length is not None:
        problems += _overlong(good, args.kind, args)
    for line in summarize(problems):
        print(line)
    for line in format_lines(good, problems, formats, detected=args.format == "auto"):
        print(line)
    files = len({p.file for p in problems})
    print(f"{len(good)} record(s) passed the record checks; {len(problems)} problem(s) in {files} file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
