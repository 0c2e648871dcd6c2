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
about (`warn_drops`, one rule for every builder: SFT, preference pairs, KTO, prompts).

Bad records follow cfg.on_error; 'strict' raises DataError at the split, save within
`collect_refusals` (how a stage validates), where every split is read and their problems are
reported together.

Every builder goes through the token cache (data_formats.token_cache): a second build of the same
data with the same tokenizer and settings reads the stored samples instead of reading, validating
and tokenising again, with the same log lines and stats ($RELAY_TOKEN_CACHE=off turns it off).
"""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Iterator, Optional

from tqdm.auto import tqdm

from data_formats.collate import IGNORE_INDEX
from data_formats.conversation import Conversation
from data_formats.render import Template, render, render_prompt, render_scored
from data_formats.sampling import SourceMix
from data_formats.sources import DataError, Problem, entry_task_name, file_entries
from data_formats.token_cache import Built, Check, build_cached, key_parts
from data_formats.tools import has_tools
from data_formats.validate import Parsed, apply_policy, every_record_bad, read_and_parse

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


_refused: Optional[list[Problem]] = None
"""While `collect_refusals` runs: the problems on_error 'strict' refused, of every split built."""


@contextmanager
def collect_refusals() -> Iterator[list[Problem]]:
    """Within it, a split that on_error 'strict' refuses (bad records, or records the template cannot
    render) does not stop the build: its problems join the yielded list (each once: a carved eval
    split reads the training files again), the split is built from its good records (and never
    stored in the token cache) and the next split is read. Stage.validate builds the data inside it,
    so the train and eval splits' problems are reported together, as one DataError."""
    global _refused
    outer, _refused = _refused, []
    try:
        yield _refused
    finally:
        _refused = outer


def _keep_refused(problems: list[Problem]) -> None:
    assert _refused is not None
    _refused.extend(p for p in dict.fromkeys(problems) if p not in _refused)


def apply_split_policy(problems: list[Problem], on_error: str, what: str) -> None:
    """on_error's policy for a split's `problems` (data_formats.validate.apply_policy); within
    `collect_refusals` a 'strict' refusal is kept there instead of raised.

    Raises:
        DataError: bad records with on_error='strict' (outside `collect_refusals`).
        ValueError: unknown on_error.
    """
    try:
        apply_policy(problems, on_error, what)
    except DataError as err:
        if _refused is None:
            raise
        _keep_refused(err.problems)


class _Refused(Exception):
    """A split built within `collect_refusals` that on_error 'strict' refused: what was built from its
    good records, raised out of the token cache so that it is not stored."""

    def __init__(self, built: Built):
        super().__init__("refused split")
        self.built = built


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


_overlong: dict[str, dict] = {}
"""The last build of each split: what it dropped as overlong, by data entry (`overlong_drops`)."""


def note_overlong(
    split: str,
    limits: dict[str, int],
    truncation: str,
    by_entry: Optional[dict],
    shorten: str = "data.truncation: truncate shortens them to fit",
) -> None:
    """Keep what a build of `split` dropped as overlong ({entry: [count, longest]}) for the problem
    line of a split that cannot fill a batch (pipeline.engine.stage_checks.fill_problem): `limits`
    are the settings that bound an item's length, by key (the least of them is the limit), `shorten`
    what data.truncation 'truncate' does."""
    _overlong[split] = {
        "limits": dict(limits),
        "truncation": truncation,
        "by_entry": dict(by_entry or {}),
        "shorten": shorten,
    }


def overlong_drops(split: str = "train") -> dict:
    """What the last build of `split` dropped as overlong: {limits, truncation, by_entry: {entry:
    [count, longest length]}, shorten} (`note_overlong`); empty when nothing was built."""
    return _overlong.get(split, {})


def _count_overlong(by_entry: dict, entry: str, length: int) -> None:
    count, longest = by_entry.get(entry, [0, 0])
    by_entry[entry] = [count + 1, max(longest, length)]


def through_cache(builder: str, cfg, tokenizer, split: str, build: Callable[[Check], Built], **args) -> Built:
    """`build` through the token cache, keyed by the builder, split, config section, the files the
    split reads, the tokenizer and the builder's other arguments `args` (token_cache.key_parts).
    Within `collect_refusals` a split on_error 'strict' refuses is built from its good records, not
    cached, and its problems kept there.

    Raises:
        DataError: bad records with on_error='strict' (outside `collect_refusals`).
        ValueError: unknown split.
    """
    entries = split_entries(cfg, split)
    _overlong.pop(split, None)  # a builder that drops overlong samples notes them after the build
    refused: list[Problem] = []

    def collecting(check: Check) -> Built:
        def checked(problems: list[Problem], what: str) -> None:
            try:
                check(problems, what)
            except DataError as err:
                refused.extend(err.problems)

        built = build(checked)
        if refused:
            raise _Refused(built)
        return built

    try:
        return build_cached(
            lambda: key_parts(builder, split, cfg, entries, tokenizer, **args),
            cfg.on_error,
            build if _refused is None else collecting,
            f"{builder} {split} data",
        )
    except _Refused as stop:
        _keep_refused(refused)
        return stop.built


DROPS = ("dropped_overlong", "dropped_no_target", "dropped_identical", "skipped_bad")
"""The counts of a build's stats that are samples left out of training: each is warned about."""


def warn_drops(what: str, stats: dict, unit: str = "sample", cut: str = "") -> None:
    """One warning per kind of drop a build counted (DROPS), e.g. `sft train data: N sample(s)
    dropped overlong`, and one for the items shortened to fit (stats' `truncated`, said as `cut`
    says how): no sample leaves the training data, nor loses tokens, unsaid. `unit` names what is
    counted (a pair for preference data, a prompt for prompts)."""
    for key in DROPS:
        if stats.get(key):
            log.warning("%s: %d %s(s) %s", what, stats[key], unit, key.replace("_", " "))
    if stats.get("truncated"):
        log.warning("%s: %d %s(s) %s", what, stats["truncated"], unit, cut or "truncated")


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
            _count_overlong(stats["overlong"], entry_of.get(record.file, record.file), length)
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
                _count_overlong(counts["overlong"], entry_of.get(record.file, record.file), max(len(c), len(r)))
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


def build_prompt_data(
    cfg,
    tokenizer,
    template: Template,
    split: str,
    max_length: Optional[int] = None,
    tools: Optional[list[dict]] = None,
    limits: Optional[dict[str, int]] = None,
) -> list[dict]:
    """PPO prompts dict(prompt_ids, text, source, standard, columns, conversation): the rendered history plus
    the assistant opener, whether the record's prompt was a plain text (1: TRL's standard type), the
    record's other fields as JSON text (the reward functions' keyword arguments) and the conversation itself as JSON
    (its turns and tools: a tool rollout continues it).
    `tools`: the schemas a tool rollout offers, given to every prompt that lists none of its own.
    Prompts over `max_length` tokens (default cfg.max_prompt_length) are dropped (truncation='drop')
    or lose their oldest user/assistant exchanges, keeping any system turn (truncation='truncate'); a
    prompt still over it is dropped. Every drop and cut is warned about (`warn_drops`), and the drops
    are noted for the line of a split that cannot fill a batch, with `limits`: the settings that
    bound a prompt, by key (default {'data.max_prompt_length': max_length}).

    Raises:
        DataError: bad records (or prompts the template cannot render) with on_error='strict'
            (outside `collect_refusals`).
        ValueError: unknown split.
    """
    limit = cfg.max_prompt_length if max_length is None else max_length
    extra = {"tools": tools} if tools else {}  # no tools: the cache key of before
    built = through_cache(
        "prompts",
        cfg,
        tokenizer,
        split,
        lambda check: _prompts(cfg, tokenizer, template, split, limit, check, tools),
        template=template,
        max_length=limit,
        **extra,
    )
    counts = built.info
    shorten = "data.truncation: truncate drops a multi-turn prompt's oldest exchanges"
    note_overlong(split, limits or {"data.max_prompt_length": limit}, cfg.truncation, counts["overlong"], shorten)
    log.info(
        "prompt %s data: %d prompt(s), %d truncated, %d dropped overlong",
        split,
        len(built.samples),
        counts["truncated"],
        counts["dropped_overlong"],
    )
    cut = f"lost their oldest exchanges to fit {limit} tokens (any system turn kept)"
    warn_drops(f"prompt {split} data", counts, "prompt", cut)
    return built.samples


def _prompts(
    cfg, tokenizer, template: Template, split: str, limit: int, check: Check, tools: Optional[list[dict]] = None
) -> Built:
    """build_prompt_data's prompts, with info {'truncated', 'dropped_overlong', 'overlong' (by entry)}."""
    records = split_records(cfg, "prompts", split, check, system_prompt=cfg.system_prompt)
    out, dropped, truncated, by_entry = [], 0, 0, {}
    entry_of = file_entries(split_entries(cfg, split))
    problems: list[Problem] = []
    for record in records:
        conv = record.value if record.value.tools or not tools else replace(record.value, tools=list(tools))
        try:
            ids = render_prompt(conv, tokenizer, template)
        except ValueError as err:  # the template cannot render this prompt
            problems.append(Problem(record.file, record.line, str(err)))
            continue
        length = len(ids)
        if len(ids) > limit and cfg.truncation == "truncate":
            system = conv.turns[:1] if conv.turns[0].role == "system" else []
            body = conv.turns[len(system) :]
            while len(ids) > limit and len(body) > 1:
                body = body[2:]
                conv = replace(conv, turns=system + body)
                ids = render_prompt(conv, tokenizer, template)
            truncated += len(ids) <= limit
        if len(ids) > limit:
            dropped += 1
            _count_overlong(by_entry, entry_of.get(record.file, record.file), length)
            continue
        out.append(
            {
                "prompt_ids": ids,
                "text": tokenizer.decode(ids),
                "source": record.source,
                "standard": int(conv.standard),
                "columns": json.dumps(conv.meta, ensure_ascii=False),
                "conversation": json.dumps(
                    {"turns": [asdict(t) for t in conv.turns], "tools": conv.tools}, ensure_ascii=False
                ),
            }
        )
    check(problems, f"prompt {split} data")
    return Built(out, {"truncated": truncated, "dropped_overlong": dropped, "overlong": by_entry})
