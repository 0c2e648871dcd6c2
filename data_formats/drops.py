"""What a build leaves out of training, and how that is said; one rule for every builder
(data_formats.datasets, pt_data, unpaired).

Refusals: bad records follow cfg.on_error; 'strict' raises DataError at the split
(`apply_split_policy`), save within `collect_refusals` (how a stage validates), where every split is
read and their problems are reported together; a split refused there is built from its good records
and never stored in the token cache (`cached_or_refused`).

Drops: each build notes the samples it dropped as overlong, by data entry (`note_overlong`,
`overlong_drops`), and every drop and every cut is warned about (`warn_drops`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from data_formats.sources import DataError, Problem
from data_formats.token_cache import Built, Check, build_cached
from data_formats.validate import apply_policy

log = logging.getLogger(__name__)

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


def cached_or_refused(
    parts: Callable[[], Optional[dict]], on_error: str, build: Callable[[Check], Built], what: str
) -> Built:
    """`build` through the token cache (token_cache.build_cached, keyed by `parts()`). Within
    `collect_refusals` a split on_error 'strict' refuses is built from its good records, not cached,
    and its problems kept there.

    Raises:
        DataError: bad records with on_error='strict' (outside `collect_refusals`).
    """
    refused: list[Problem] = []

    def collecting(check: Check) -> Built:
        def checked(problems: list[Problem], check_what: str) -> None:
            try:
                check(problems, check_what)
            except DataError as err:
                refused.extend(err.problems)

        built = build(checked)
        if refused:
            raise _Refused(built)
        return built

    try:
        return build_cached(parts, on_error, build if _refused is None else collecting, what)
    except _Refused as stop:
        _keep_refused(refused)
        return stop.built


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


def forget_overlong(split: str) -> None:
    """Forget what the last build of `split` dropped as overlong: a build about to run notes its own
    after it (`note_overlong`)."""
    _overlong.pop(split, None)


def overlong_drops(split: str = "train") -> dict:
    """What the last build of `split` dropped as overlong: {limits, truncation, by_entry: {entry:
    [count, longest length]}, shorten} (`note_overlong`); empty when nothing was built."""
    return _overlong.get(split, {})


def count_overlong(by_entry: dict, entry: str, length: int) -> None:
    """Count one item of `length` tokens dropped as overlong under its data `entry` in `by_entry`
    ({entry: [count, longest]})."""
    count, longest = by_entry.get(entry, [0, 0])
    by_entry[entry] = [count + 1, max(longest, length)]


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
