"""Building training data for each stage: read -> validate -> split -> render/tokenize -> samples.

Task naming rule (multitask SFT): a record's `data_name` when present, else the name of the data
path entry it came from (file stem, folder name, glob folder, or dataset name). Task ids index the
sorted task names; pass `tasks=train.tasks` when building eval so ids agree across splits.

Splits: 'train' reads cfg.train; 'eval' reads cfg.eval, or, when that is empty and
cfg.eval_fraction > 0, the training records whose content hash falls below the fraction (and
those are then removed from train). The hash is of the record's text, so the split does not
depend on any RNG or on file order, and duplicate records land on the same side.

Overlong samples follow cfg.truncation: 'drop' drops them; 'truncate' keeps the longest run of
whole early turns that ends with an assistant turn and fits. Samples left with no supervised
token are dropped. Every drop and every cut is counted, reported in the returned stats and warned
about (data_formats.drops.warn_drops, one rule for every builder: SFT, preference pairs, KTO,
prompts).

Bad records follow cfg.on_error; 'strict' raises DataError at the split, save within
`collect_refusals` (data_formats.drops; how a stage validates), where every split is read and their
problems are reported together.

Every builder goes through the token cache (data_formats.token_cache): a second build of the same
data with the same tokenizer and settings reads the stored samples instead of reading, validating
and tokenising again, with the same log lines and stats ($RELAY_TOKEN_CACHE=off turns it off).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from tqdm.auto import tqdm

from data_formats.collate import IGNORE_INDEX
from data_formats.conversation import Conversation
from data_formats.drops import (
    apply_split_policy,
    cached_or_refused,
    count_overlong,
    forget_overlong,
    note_overlong,
    warn_drops,
)
from data_formats.render import Template, render, render_scored
from data_formats.sampling import SourceMix
from data_formats.sources import Problem, entry_task_name, file_entries
from data_formats.token_cache import Built, Check, key_parts
from data_formats.tools import has_tools
from data_formats.validate import Parsed, every_record_bad, read_and_parse

log = logging.getLogger(__name__)
SPLITS = ("train", "eval")


@dataclass
class TaskSamples:
    """The SFT training or eval split: its samples and task names (`build_sft_data`)."""

    samples: list[dict]
    """dict(input_ids, labels, task_id, source) per sample."""
    tasks: list[str]
    """Task names; a sample's task_id indexes this list."""
    stats: dict = field(default_factory=dict)
    """Counts: records, samples, truncated, dropped_overlong, dropped_no_target, skipped_bad,
    tool_conversations (samples with tools, calls or tool results)."""

    def __len__(self) -> int:
        return len(self.samples)


def in_eval_fraction(raw: str, fraction: float) -> bool:
    """Whether a record (by its text) belongs to the carved-off eval fraction."""
    if fraction <= 0:
        return False
    value = int.from_bytes(hashlib.sha256(raw.encode("utf-8")).digest()[:8], "big") / 2**64
    return value < fraction


def split_entries(cfg, split: str) -> list[str]:
    """The data path entries a split reads (none for 'eval' when there is no eval data to read or
    carve; see the module docstring).

    Raises:
        ValueError: unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    carve = not cfg.eval and cfg.eval_fraction > 0
    if split == "eval" and not cfg.eval and not carve:
        return []
    return cfg.eval if split == "eval" and cfg.eval else cfg.train


def split_records(cfg, kind: str, split: str, check: Optional[Check] = None, **parse_kwargs) -> list[Parsed]:
    """The validated records of one split (see the module docstring); bad records follow
    cfg.on_error, through `check(problems, what)` when given (see token_cache.build_cached).

    Raises:
        ValueError: unknown split.
        DataError: bad records with on_error='strict' (outside `collect_refusals`).
    """
    entries = split_entries(cfg, split)
    if not entries:
        return []
    good, problems = read_and_parse(
        entries, kind, fmt=cfg.format, max_record_bytes=cfg.max_record_bytes, **parse_kwargs
    )
    if cfg.on_error == "skip":
        problems += every_record_bad(good, problems)
    if check is None:
        apply_split_policy(problems, cfg.on_error, f"{kind} {split} data")
    else:
        check(problems, f"{kind} {split} data")
    carve = not cfg.eval and cfg.eval_fraction > 0
    if carve:
        good = [r for r in good if in_eval_fraction(r.raw, cfg.eval_fraction) == (split == "eval")]
    if split == "train" and cfg.record_limit is not None:
        good = good[: cfg.record_limit]
    return good


def _fit(
    conv: Conversation, tokenizer, template: Template, seq_length: int, truncation: str
) -> tuple[Optional[tuple[list[int], list[int]]], str, int]:
    """(ids, labels) or None, what happened ('ok', 'truncated', 'dropped_overlong'), and the whole
    conversation's length in tokens."""
    ids, labels = render(conv, tokenizer, template)
    length = len(ids)
    if length <= seq_length:
        return (ids, labels), "ok", length
    if truncation == "truncate":
        ends = [i for i, t in enumerate(conv.turns) if t.role == "assistant"]
        for end in reversed(ends[:-1]):
            shorter = replace(conv, turns=conv.turns[: end + 1])
            ids, labels = render(shorter, tokenizer, template)
            if len(ids) <= seq_length:
                return (ids, labels), "truncated", length
    return None, "dropped_overlong", length


def through_cache(builder: str, cfg, tokenizer, split: str, build: Callable[[Check], Built], **args) -> Built:
    """`build` through the token cache, keyed by the builder, split, config section, the files the
    split reads, the tokenizer and the builder's other arguments `args` (token_cache.key_parts).
    Within `collect_refusals` a split on_error 'strict' refuses is built from its good records, not
    cached, and its problems kept there (drops.cached_or_refused).

    Raises:
        DataError: bad records with on_error='strict' (outside `collect_refusals`).
        ValueError: unknown split.
    """
    entries = split_entries(cfg, split)
    forget_overlong(split)  # a builder that drops overlong samples notes them after the build
    return cached_or_refused(
        lambda: key_parts(builder, split, cfg, entries, tokenizer, **args),
        cfg.on_error,
        build,
        f"{builder} {split} data",
    )


def _log_stats(what: str, stats: dict, seq_length: int) -> None:
    log.info("%s: %s", what, ", ".join(f"{k}={v}" for k, v in stats.items() if k != "overlong"))
    cut = (
        f"lost their last turns to fit seq_length {seq_length} (each keeps its longest run of whole early "
        "turns that ends with an assistant turn)"
    )
    warn_drops(what, stats, cut=cut)


def build_sft_data(
    cfg, tokenizer, template: Template, seq_length: int, split: str, tasks: Optional[list[str]] = None
) -> TaskSamples:
    """Tokenized SFT samples of one split, with per-sample task ids.

    Raises:
        DataError: bad records (or conversations the template cannot render) with on_error='strict'
            (outside `collect_refusals`).
        ValueError: unknown split or truncation policy.
    """
    if cfg.truncation not in ("drop", "truncate"):
        raise ValueError(f"truncation must be 'drop' or 'truncate', got {cfg.truncation!r}")
    built = through_cache(
        "sft",
        cfg,
        tokenizer,
        split,
        lambda check: _sft_samples(cfg, tokenizer, template, seq_length, split, tasks, check),
        template=template,
        seq_length=seq_length,
        tasks=tasks,
    )
    _log_stats(f"sft {split} data", built.info["stats"], seq_length)
    note_overlong(split, {"train.seq_length": seq_length}, cfg.truncation, built.info["stats"].get("overlong"))
    return TaskSamples(built.samples, built.info["tasks"], built.info["stats"])


def _sft_samples(
    cfg, tokenizer, template: Template, seq_length: int, split: str, tasks: Optional[list[str]], check: Check
) -> Built:
    """build_sft_data's samples, with info {'tasks', 'stats'}."""
    unread: list[Problem] = []  # records skipped as they were read (on_error: skip), before rendering

    def check_reading(problems: list[Problem], what: str) -> None:
        check(problems, what)
        if cfg.on_error == "skip":  # a strict refusal kept by collect_refusals is no skipped record
            unread.extend(problems)

    records = split_records(cfg, "sft", split, check_reading, system_prompt=cfg.system_prompt)
    names = list(tasks) if tasks is not None else []
    names += sorted({r.task for r in records} - set(names))
    index = {name: i for i, name in enumerate(names)}
    entry_of = file_entries(split_entries(cfg, split))
    stats = {
        "records": len(records),
        "samples": 0,
        "truncated": 0,
        "dropped_overlong": 0,
        "dropped_no_target": 0,
        "skipped_bad": 0,
        "tool_conversations": 0,
        "overlong": {},
    }
    samples, problems = [], []
    for record in tqdm(records, desc=f"tokenizing sft {split}", disable=len(records) < 1000):
        try:
            fitted, outcome, length = _fit(record.value, tokenizer, template, seq_length, cfg.truncation)
        except ValueError as err:
            problems.append(Problem(record.file, record.line, str(err)))
            continue
        if fitted is None:
            stats[outcome] += 1
            count_overlong(stats["overlong"], entry_of.get(record.file, record.file), length)
            continue
        stats["truncated"] += outcome == "truncated"
        ids, labels = fitted
        if all(label == IGNORE_INDEX for label in labels):
            stats["dropped_no_target"] += 1
            continue
        samples.append({"input_ids": ids, "labels": labels, "task_id": index[record.task], "source": record.source})
        stats["tool_conversations"] += has_tools(record.value)
    check(problems, f"sft {split} data")
    stats["skipped_bad"] = len(unread) + (len(problems) if cfg.on_error == "skip" else 0)
    stats["samples"] = len(samples)
    return Built(samples, {"tasks": names, "stats": stats})


def source_mix(cfg, samples: list, seed: int) -> Optional[SourceMix]:
    """The weighted mix of the training entries (cfg.weights) over the built `samples`, or None
    when the split is not weighted. A sample's entry is its `entry` (PT rows) or the entry that
    reads the file its `source` (FILE:LINE) names.

    Raises:
        ValueError: a sample that names no entry's file.
    """
    if not getattr(cfg, "weights", None):
        return None
    entries = list(cfg.train)
    index = {entry: k for k, entry in enumerate(entries)}
    entry_of = file_entries(entries)
    owners = []
    for sample in samples:
        if "entry" in sample:
            owners.append(int(sample["entry"]))
            continue
        file = str(sample.get("source", "")).rpartition(":")[0]
        if file not in entry_of:
            raise ValueError(
                f"data.weights: cannot tell which data.train entry the sample from {sample.get('source')!r} came from"
            )
        owners.append(index[entry_of[file]])
    labels = [entry_task_name(entry) for entry in entries]
    labels = [label if labels.count(label) == 1 else f"{label}#{k}" for k, label in enumerate(labels)]
    return SourceMix(entries, list(cfg.weights), cfg.mix_stop, seed, owners, labels)


def fit_pair(
    prompts: tuple[list[int], list[int]], responses: tuple[list[int], list[int]], seq_length: int
) -> Optional[tuple[list[int], list[int], int]]:
    """The two sides of a pair as (prompt + response) ids within `seq_length`, cutting the oldest
    prompt tokens (from the left, the same number kept on both sides) so that the responses and
    their end-of-turn read-out tokens stay whole, as preference trainers do. Returns (chosen ids,
    rejected ids, prompt tokens cut from the longer side), or None when a response alone does
    not leave room for one prompt token."""
    keep = seq_length - max(len(r) for r in responses)
    if keep < 1:
        return None
    cut = max(0, max(len(p) for p in prompts) - keep)
    chosen, rejected = (p[max(0, len(p) - keep) :] + r for p, r in zip(prompts, responses))
    return chosen, rejected, cut


def build_preference_data(
    cfg, tokenizer, template: Template, seq_length: int, split: str, stats: Optional[dict] = None
) -> list[dict]:
    """Pairs dict(chosen_input_ids, rejected_input_ids, chosen_answer_len, rejected_answer_len,
    margin, source). Each side is the rendered
    prompt followed by its answer, ending at the answer's end-of-turn token (`render_scored`: the
    token a reward is read at, the same one PPO reads). `stats`, when given, receives the counts
    (tool_conversations: pairs with tools, calls or tool results on either side). Overlong pairs are dropped
    (truncation='drop') or lose their oldest prompt tokens (truncation='truncate', `fit_pair`);
    pairs whose answer alone is too long, or whose two sides are identical, are dropped. What was
    cut and dropped is logged, every drop as a warning (`warn_drops`).

    Raises:
        DataError: bad records (or pairs the template cannot render) with on_error='strict'.
        ValueError: unknown split.
    """
    built = through_cache(
        "rm",
        cfg,
        tokenizer,
        split,
        lambda check: _preference_pairs(cfg, tokenizer, template, seq_length, split, check),
        template=template,
        seq_length=seq_length,
    )
    counts = built.info
    note_overlong(split, {"train.seq_length": seq_length}, cfg.truncation, counts.get("overlong"))
    if stats is not None:
        stats.update(counts)
    log.info(
        "rm %s data: %d pair(s), %d dropped overlong, %d dropped identical",
        split,
        len(built.samples),
        counts["dropped_overlong"],
        counts["identical"],
    )
    cut = (
        f"lost their oldest prompt tokens to fit seq_length {seq_length} ({counts['prompt_tokens_cut']} token(s) "
        f"in all, at most {counts['max_prompt_cut']} from one pair); every response and its end-of-turn token kept"
    )
    warn_drops(
        f"rm {split} data",
        {
            "dropped_overlong": counts["dropped_overlong"],
            "dropped_identical": counts["identical"],
            "truncated": counts["truncated"],
        },
        "pair",
        cut,
    )
    return built.samples


def _preference_pairs(cfg, tokenizer, template: Template, seq_length: int, split: str, check: Check) -> Built:
    """build_preference_data's pairs, with info: the counts it logs."""
    records = split_records(
        cfg, "rm", split, check, system_prompt=cfg.system_prompt, margin_field=getattr(cfg, "margin_field", None)
    )
    out: list[dict] = []
    problems: list[Problem] = []
    counts = {
        "dropped_overlong": 0,
        "truncated": 0,
        "prompt_tokens_cut": 0,
        "max_prompt_cut": 0,
        "identical": 0,
        "tool_conversations": 0,
        "overlong": {},
    }
    entry_of = file_entries(split_entries(cfg, split))
    for record in tqdm(records, desc=f"tokenizing rm {split}", disable=len(records) < 1000):
        chosen, rejected, margin = record.value
        counts["tool_conversations"] += has_tools(chosen) or has_tools(rejected)
        try:
            (cp, cr), (rp, rr) = (
                render_scored(chosen, tokenizer, template),
                render_scored(rejected, tokenizer, template),
            )
        except ValueError as err:  # the template cannot render this pair
            problems.append(Problem(record.file, record.line, str(err)))
            continue
        c, r = cp + cr, rp + rr
        if max(len(c), len(r)) > seq_length:
            fitted = fit_pair((cp, rp), (cr, rr), seq_length) if cfg.truncation == "truncate" else None
            if fitted is None:
                counts["dropped_overlong"] += 1
                count_overlong(counts["overlong"], entry_of.get(record.file, record.file), max(len(c), len(r)))
                continue
            c, r, cut = fitted
            counts["truncated"] += 1
            counts["prompt_tokens_cut"] += cut
            counts["max_prompt_cut"] = max(counts["max_prompt_cut"], cut)
        if c == r:
            counts["identical"] += 1
            continue
        # The answers are never cut (fit_pair cuts prompts), so each side's answer is its last tokens.
        out.append(
            {
                "chosen_input_ids": c,
                "rejected_input_ids": r,
                "chosen_answer_len": len(cr),
                "rejected_answer_len": len(rr),
                "margin": margin,
                "source": record.source,
            }
        )
    check(problems, f"rm {split} data")
    return Built(out, counts)
