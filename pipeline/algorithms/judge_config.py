"""The `judge:` section of the RL stages (GRPO, PPO) and `relay sample`: which OpenAI-compatible endpoint
scores answers, with which rubric, how its reply becomes a score, and the limits of the requests,
each option checked with the others before any model loads. What sends the requests and keeps their
cache is pipeline/algorithms/judge.py."""

from __future__ import annotations

import math
import os
import re
import string
from dataclasses import dataclass, field
from typing import Optional, Sequence

DEFAULT_TEMPLATE = (
    "Rate how well the answer responds to the question, from 0 (useless or wrong) to 10 (correct, "
    "complete and clear). Reply with the number only.\n\nQuestion:\n{question}\n\nAnswer:\n{answer}"
)
FIELDS = ("question", "answer", "reference")


SCORE_FROM = ("text", "logprobs")
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on top_logprobs (vLLM's default and `relay serve`'s too)."""


@dataclass
class JudgeConfig:
    base_url: Optional[str] = None
    """The OpenAI-compatible endpoint up to /v1 (http://127.0.0.1:8000/v1 for `relay serve`); null: no judge."""
    model: str = ""
    """The model name the endpoint serves (the request's `model`)."""
    api_key_env: Optional[str] = None
    """The environment variable holding the API key (sent as a Bearer token); null: no key. The key
    itself never goes into a config, a cache, a log or a manifest."""
    template: str = DEFAULT_TEMPLATE
    """The rubric sent as the user message, with {question}, {answer} and, when reference_column is
    set, {reference} (write literal braces as {{ }})."""
    system: Optional[str] = None
    """An optional system message before the rubric."""
    reference_column: Optional[str] = None
    """The prompt record field filled into {reference} (a reference answer, a policy excerpt)."""
    score_range: Optional[list[float]] = field(default_factory=lambda: [0.0, 10.0])
    """[lo, hi]: the reply's number must lie in it and is normalised to [0, 1]. Null with choices."""
    choices: Optional[dict[str, float]] = None
    """{label: score}: the reply's label mapped to its score (e.g. {"PASS": 1.0, "FAIL": 0.0}); set score_range null."""
    pattern: Optional[str] = None
    """A regex whose first group, in its last match, is the number or label (null: the first number /
    the last label anywhere in the reply)."""
    score_from: str = "text"
    """text: parse the reply; logprobs (with choices): the labels' probabilities as the judge's first
    token, from the endpoint's top_logprobs (one token asked for, no reply text read)."""
    top_logprobs: int = MAX_TOP_LOGPROBS
    """With score_from logprobs: how many most likely first tokens the endpoint lists (1 to 20)."""
    weight: float = 1.0
    """Weight of the judge's score in the summed reward."""
    max_concurrency: int = 8
    """Requests in flight at most, over every rank (each rank asks for its own completions, through
    an equal share)."""
    timeout: float = 30.0
    """Seconds a request may take."""
    retries: int = 2
    """Further attempts after a timeout, a connection error, 429 or 5xx."""
    retry_backoff: float = 1.0
    """Seconds before the first retry, doubling after each."""
    on_failure: Optional[float] = None
    """The score of a completion whose request still fails (or whose reply cannot be parsed), counted in
    judge/failures; null: such a failure stops the run."""
    max_tokens: int = 16
    """The judge's reply length (score_from logprobs asks for 1 token)."""
    temperature: float = 0.0
    """The judge's sampling temperature (0: greedy, a reproducible judge)."""
    cache: bool = True
    """Reuse replies to identical requests, in memory and in OUTPUT_DIR/judge_cache/ (a resumed run reuses them).
    Replies are kept, not scores: each is scored by the current score_range, choices and pattern."""
    gold_column: Optional[str] = None
    """A prompt record field with the verified answer: judge/gold_agreement is the share of completions
    where the judge's pass (score >= pass_score) agrees with the answer stating it (the reward-hacking signal)."""
    pass_score: float = 0.5
    """The score at or above which the judge counts as passing an answer (for judge/gold_agreement)."""

    @property
    def enabled(self) -> bool:
        return bool(self.base_url)

    def problems(self, key: str = "judge") -> list[str]:
        """Every problem with the section, one line each (nothing is contacted)."""
        if not self.enabled:
            return []
        out: list[str] = []
        if not re.match(r"https?://", self.base_url or ""):
            out.append(f"{key}.base_url: {self.base_url!r} is not an http(s) URL")
        if not self.model:
            out.append(f"{key}.model: required (the name the endpoint serves)")
        if self.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            out.append(
                f"{key}.api_key_env: {self.api_key_env!r} is not an environment variable name (give the variable's "
                f"name, never the key)"
            )
        elif self.api_key_env and self.api_key_env not in os.environ:
            out.append(f"{key}.api_key_env: the environment variable {self.api_key_env} is not set")
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        except ValueError as err:
            names, _ = set(), out.append(f"{key}.template: {err} (write literal braces as {{{{ }}}})")
        for name in sorted(names - set(FIELDS)):
            out.append(f"{key}.template: unknown field {{{name}}} (known: {', '.join('{%s}' % f for f in FIELDS)})")
        if "answer" not in names and not out:
            out.append(f"{key}.template: has no {{answer}}; the judge would never see the completion")
        if "reference" in names and not self.reference_column:
            out.append(f"{key}.template: uses {{reference}} but {key}.reference_column is not set")
        if (self.score_range is None) == (self.choices is None):
            out.append(f"{key}.score_range/choices: set exactly one (a number in a range, or labels mapped to scores)")
        elif self.score_range is not None and (
            len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]
        ):
            out.append(f"{key}.score_range: must be [lo, hi] with lo < hi, got {self.score_range}")
        elif self.choices is not None and not self.choices:
            out.append(f"{key}.choices: empty")
        out += self._logprob_problems(key)
        if self.pattern is not None:
            try:
                if re.compile(self.pattern).groups < 1:
                    out.append(f"{key}.pattern: needs one capturing group (the number or label)")
            except re.error as err:
                out.append(f"{key}.pattern: not a regex ({err})")
        for name, low in (("max_concurrency", 1), ("max_tokens", 1), ("retries", 0)):
            if getattr(self, name) < low:
                out.append(f"{key}.{name}: must be >= {low}, got {getattr(self, name)}")
        if self.timeout <= 0 or self.retry_backoff < 0:
            out.append(f"{key}.timeout/retry_backoff: must be > 0 and >= 0")
        if self.on_failure is not None and not math.isfinite(self.on_failure):
            out.append(f"{key}.on_failure: must be a finite score or null (stop the run), got {self.on_failure}")
        return out

    def rank_problems(self, ranks: int, key: str = "judge") -> list[str]:
        """The one line refusing a judge whose max_concurrency cannot give each of `ranks` processes a
        request in flight (each rank asks for its own completions), or []."""
        if not self.enabled or ranks <= self.max_concurrency:
            return []
        return [
            f"{key}.max_concurrency: {self.max_concurrency} requests in flight cannot be shared by the {ranks} ranks "
            f"that each ask the judge for their own completions; set it to at least {ranks}"
        ]

    def _logprob_problems(self, key: str) -> list[str]:
        if self.score_from not in SCORE_FROM:
            return [f"{key}.score_from: must be one of {', '.join(SCORE_FROM)}, got {self.score_from!r}"]
        if self.score_from == "text":
            return []
        out = []
        if self.choices is None:
            out.append(
                f"{key}.score_from: logprobs weighs the labels of {key}.choices by their probabilities; set "
                f"choices (and score_range null): a number in a range is read from reply text only"
            )
        if self.pattern is not None:
            out.append(f"{key}.pattern: reads reply text, which score_from logprobs does not ask for; remove it")
        if not 1 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            out.append(f"{key}.top_logprobs: must be in [1, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        seen: dict[str, tuple[str, float]] = {}
        for label, score in (self.choices or {}).items():
            norm = label_key(label)
            if not norm:
                out.append(f"{key}.choices: the label {label!r} is empty once stripped of whitespace")
            elif norm in seen and seen[norm][1] != score:
                out.append(
                    f"{key}.choices: {seen[norm][0]!r} and {label!r} are one label for score_from logprobs "
                    f"(whitespace and case ignored) with two scores ({seen[norm][1]} and {score})"
                )
            seen.setdefault(norm, (label, score))
        return out

    def manifest_record(self) -> dict:
        """What judged the policy, for the merged model's manifest: the endpoint and the model (never the key)."""
        return {"judge": {"base_url": self.base_url, "model": self.model}} if self.enabled else {}

    def record_problems(self, records: Sequence[dict], key: str = "judge") -> list[str]:
        """The prompt records' fields the section needs: the reference column in every record."""
        col = self.reference_column
        if not self.enabled or not col:
            return []
        missing = sum(1 for r in records if r.get(col) is None)
        return (
            [f"{key}.reference_column: {missing} of {len(records)} prompt records have no {col!r} field"]
            if missing
            else []
        )


def label_key(token: str) -> str:
    """A label or a token as score_from logprobs compares them: stripped of whitespace, case-folded."""
    return token.strip().casefold()
