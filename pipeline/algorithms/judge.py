"""An LLM judge as a reward: a rubric sent to any OpenAI-compatible chat endpoint (`relay serve`,
vLLM's server, a hosted API), its reply parsed into a score.

For answers no rule can check (medical, legal, support), a keyword reward gets hacked and a reward
model needs preference data; a judge the user already runs needs neither. What a hand-written HTTP
call inside a reward function lacks is here:

- `max_concurrency`: at most that many requests in flight over every rank (each rank asks for its
  own completions through a thread pool of an equal share: `max_concurrency // ranks`);
- `timeout` and `retries` (connection errors, timeouts, 429 and 5xx are retried with a doubling
  backoff; other 4xx and an unparsable reply are not: a retry would get the same answer);
- `on_failure`: the score a completion gets when its request still fails, counted in
  `judge/failures` and logged; null stops the run instead. Never a silent 0;
- a cache of the judge's replies keyed on the full request (endpoint, model, messages, sampling):
  identical completions in a group cost one request, and a resumed run reuses the replies its first
  life received. The cache keeps what the endpoint said (the reply text, or the first token's
  top_logprobs), never a score: each reply is scored by the rules in force (`score_range`,
  `choices`, `pattern`), so a rerun with other rules rescores the same replies without asking
  again. A reply that gave a score when it came is kept; one that gave none is asked again later.
  Each cached reply is tagged with the optimizer step that asked for it, and a run resumed at step
  s sees only the replies tagged <= s, exactly the cache an unbroken run held at that point, so the
  cache never makes a resumed run differ from an unbroken one;
- the API key is read from the environment variable `api_key_env` names at request time: neither
  the key nor the header is stored in the config, the cache, a log line or an error message.

The score parser: with `score_range: [lo, hi]` the first number of the reply (or the first group of
`pattern`'s last match) must lie in the range and is normalised to [0, 1]; with `choices: {label:
score}` the last whole-word label in the reply (or `pattern`'s group) is mapped to its score.

`score_from: logprobs` (with `choices`) reads no reply text: the request asks for one token with
`logprobs` and `top_logprobs: K`, and the score is the expectation of the labels' scores under the
judge's probabilities of the first token (G-Eval's weighting of the rating by its probability):
sum_label P(label) * score(label) / sum_label P(label), where P(label) sums the probabilities of
the top-K tokens equal to the label once both are stripped of whitespace and case-folded ("YES",
"Yes" and " yes" are all the label yes; labels equal under that rule must carry one score). A
judge whose reply text ignores the rubric's format may still put its probability on the right
label. A first token with no label among its top K is a failure (`on_failure`, counted), never a
silent score; a label absent from the top K counts as probability 0. Each label must be one token
of the judge's tokenizer to be seen at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from pipeline.algorithms.judge_config import JudgeConfig, label_key
from pipeline.engine.interrupt import EarlyEnd

log = logging.getLogger("relay.judge")

RETRIED_STATUS = (408, 409, 429, 500, 502, 503, 504)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
CACHE_FORMAT = 2
"""The `format` of a cache line: {"format", "tag", "key", "reply": `judge_reply`'s}. Lines of another
format (an older Relay's kept scores, not replies) are ignored, their requests asked again."""


class JudgeError(EarlyEnd):
    """A judge request failed and `on_failure` is null; the message is one line (the stage ends with
    it, pipeline/engine/stage_main.py)."""


def parse_score(reply: str, cfg: JudgeConfig) -> Optional[float]:
    """The score a reply gives (module docstring), or None when it gives none (pure)."""
    if cfg.pattern is not None:
        found = list(re.finditer(cfg.pattern, reply))
        token = found[-1].group(1) if found else None
    elif cfg.choices is not None:
        labels = sorted(cfg.choices, key=len, reverse=True)
        found = list(re.finditer(r"(?<!\w)(" + "|".join(map(re.escape, labels)) + r")(?!\w)", reply))
        token = found[-1].group(1) if found else None
    else:
        first = NUMBER.search(reply)
        token = first.group(0) if first else None
    if token is None:
        return None
    if cfg.choices is not None:
        return cfg.choices.get(token.strip())
    try:
        value = float(token)
    except ValueError:
        return None
    lo, hi = cfg.score_range
    return (value - lo) / (hi - lo) if lo <= value <= hi else None


def parse_logprobs(top_logprobs: Sequence[dict], cfg: JudgeConfig) -> tuple[Optional[float], str]:
    """(score, summary) from the first token's top_logprobs ([{"token", "logprob"}, ...]): the labels'
    scores weighted by their probabilities (module docstring); score None when no listed token is a
    label. The summary names the labels' probabilities, or the most likely tokens when none is one (pure)."""
    scores = {label_key(label): float(score) for label, score in (cfg.choices or {}).items()}
    mass: dict[str, float] = {}
    for entry in top_logprobs:
        name = label_key(entry["token"])
        if name in scores:
            mass[name] = mass.get(name, 0.0) + math.exp(float(entry["logprob"]))
    total = sum(mass.values())
    if total <= 0:
        listed = ", ".join(repr(e["token"]) for e in list(top_logprobs)[:5])
        return None, f"no label among the first token's top {len(top_logprobs)} (most likely: {listed})"
    summary = " ".join(f"P({name})={p:.4g}" for name, p in sorted(mass.items()))
    return sum(p * scores[name] for name, p in mass.items()) / total, summary


def judge_reply(payload: dict, cfg: JudgeConfig) -> dict:
    """What a score is read from in a chat.completion object, as the cache keeps it: {"text": the
    reply}, or with score_from logprobs {"top_logprobs": the first token's [{"token", "logprob"}],
    None when the reply has no logprobs}.

    Raises:
        KeyError, IndexError, TypeError, AttributeError, ValueError: not a chat.completion object.
    """
    choice = payload["choices"][0]
    if cfg.score_from != "logprobs":
        return {"text": choice["message"].get("content") or ""}
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return {"top_logprobs": None}
    top = content[0].get("top_logprobs") or []
    return {"top_logprobs": [{"token": str(e["token"]), "logprob": float(e["logprob"])} for e in top]}


def reply_score(reply: dict, cfg: JudgeConfig) -> tuple[Optional[float], Optional[str]]:
    """(score, why it gave none) of a reply as `judge_reply` keeps it, under `cfg`'s scoring rules:
    its text parsed, or with score_from logprobs its first token's top_logprobs weighed (pure)."""
    if cfg.score_from != "logprobs":
        text = reply["text"]
        score = parse_score(text, cfg)
        return score, None if score is not None else f"unparsable reply {text[:60]!r}"
    if reply["top_logprobs"] is None:
        return None, "the reply has no logprobs (does the endpoint support logprobs and top_logprobs?)"
    score, summary = parse_logprobs(reply["top_logprobs"], cfg)
    return score, None if score is not None else summary


def render_messages(cfg: JudgeConfig, question: str, answer: str, reference: Optional[str] = None) -> list[dict]:
    """The chat messages of one judge request (pure)."""
    text = cfg.template.format(question=question, answer=answer, reference="" if reference is None else reference)
    return ([{"role": "system", "content": cfg.system}] if cfg.system else []) + [{"role": "user", "content": text}]


def request_body(cfg: JudgeConfig, messages: list[dict]) -> dict:
    body = {"model": cfg.model, "messages": messages, "temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    if cfg.score_from == "logprobs":
        body.update(max_tokens=1, logprobs=True, top_logprobs=cfg.top_logprobs)
    return body


def request_key(cfg: JudgeConfig, body: dict) -> str:
    """The cache key: a hash of the endpoint and the full request body (never the API key). The
    scoring rules are not in it: the cache keeps replies, scored when read (`reply_score`)."""
    return hashlib.sha256(json.dumps([cfg.base_url, body], sort_keys=True).encode()).hexdigest()


@dataclass
class Outcome:
    reply: Optional[dict]
    """`judge_reply`'s; None when the request failed (`error` says why)."""
    error: Optional[str]
    seconds: float
    attempts: int


@dataclass
class JudgeStats:
    """Counts since the last `take_figures` (and `totals` over the run)."""

    requests: int = 0
    cache_hits: int = 0
    failures: int = 0
    attempts: int = 0
    seconds: float = 0.0
    agree: int = 0
    judged_gold: int = 0

    def add(self, other: "JudgeStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class JudgeReward:
    """Scores completions through the judge endpoint (`score`), with the cache and the counts."""

    def __init__(self, cfg: JudgeConfig, cache_file: Optional[Path] = None, ranks: int = 1):
        """`ranks`: the processes asking the endpoint at once, each through an equal share of
        `max_concurrency` (at least one request each: `JudgeConfig.rank_problems`)."""
        self.cfg = cfg
        self.workers = max(1, cfg.max_concurrency // ranks)
        """Requests in flight at most from this process."""
        self.cache_file = Path(cache_file) if cache_file is not None and cfg.cache else None
        self.cache: dict[str, tuple[int, dict]] = {}
        """key -> (step tag, `judge_reply`'s reply)."""
        self.opened = False
        self.pending = JudgeStats()
        self.totals = JudgeStats()

    # --- cache -------------------------------------------------------------------------------

    def open(self, steps_done: int) -> None:
        """Load the disk cache as an unbroken run held it after `steps_done` optimizer steps: entries
        tagged <= steps_done (none on a fresh start), rewriting the file without the rest."""
        self.opened = True
        if self.cache_file is None:
            return
        kept, other_format = [], 0
        if steps_done > 0 and self.cache_file.is_file():
            for line in self.cache_file.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if entry.get("format") != CACHE_FORMAT:
                    other_format += 1
                elif entry.get("tag", math.inf) <= steps_done:
                    self.cache[entry["key"]] = (entry["tag"], entry["reply"])
                    kept.append(line)
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        self.cache_file.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
        if other_format:
            log.info(
                "judge: %d entries of %s are not cache format %d (they hold no reply to rescore); "
                "their requests are asked again",
                other_format,
                self.cache_file,
                CACHE_FORMAT,
            )
        if kept:
            log.info("judge: %d cached replies reused from %s", len(kept), self.cache_file)

    def _remember(self, new: dict[str, tuple[int, dict]]) -> None:
        if not self.cfg.cache or not new:
            return
        self.cache.update(new)
        if self.cache_file is not None:
            with open(self.cache_file, "a", encoding="utf-8") as fh:
                for key, (tag, reply) in new.items():
                    line = {"format": CACHE_FORMAT, "tag": tag, "key": key, "reply": reply}
                    fh.write(json.dumps(line) + "\n")

    # --- requests ----------------------------------------------------------------------------

    def _headers(self) -> dict:
        headers = {"Content-Type": "application/json"}
        env = self.cfg.api_key_env
        if env:
            key = os.environ.get(env)
            if not key:
                raise JudgeError(f"judge.api_key_env: the environment variable {env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def _post(self, body: dict, headers: dict) -> Outcome:
        """One request with its retries; never raises (the error is in the outcome, without headers)."""
        cfg = self.cfg
        url = cfg.base_url.rstrip("/") + "/chat/completions"
        data = json.dumps(body).encode()
        started, error, attempt = time.perf_counter(), None, 0
        for attempt in range(1, cfg.retries + 2):
            if attempt > 1:
                time.sleep(cfg.retry_backoff * 2 ** (attempt - 2))
            try:
                request = urllib.request.Request(url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=cfg.timeout) as response:
                    payload = json.loads(response.read().decode("utf-8"))
                reply = judge_reply(payload, cfg)
            except urllib.error.HTTPError as err:
                error = f"HTTP {err.code}"
                if err.code in RETRIED_STATUS:
                    continue
                break
            except (TimeoutError, OSError) as err:  # URLError, socket.timeout, connection refused/reset
                reason = getattr(err, "reason", err)
                error = (
                    "timeout"
                    if isinstance(reason, TimeoutError) or "timed out" in str(reason)
                    else f"connection: {reason}"
                )
                continue
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                error = "not an OpenAI chat.completion response"
                break
            return Outcome(reply, None, time.perf_counter() - started, attempt)
        return Outcome(None, error, time.perf_counter() - started, attempt)

    def score(
        self,
        questions: Sequence[str],
        answers: Sequence[str],
        references: Optional[Sequence[Optional[str]]] = None,
        *,
        tag: int = 0,
        golds: Optional[Sequence[Optional[bool]]] = None,
    ) -> list[float]:
        """One score per answer. Identical requests (in this call or cached) cost one request; the
        rest run `self.workers` (this rank's share of `max_concurrency`) at a time. Every reply, new
        or cached, is scored by `self.cfg`'s rules (`reply_score`). `tag`: the
        optimizer step asking (see `open`); `golds`: whether each answer states the verified answer
        (None: unknown), for the agreement count.

        Raises:
            JudgeError: a request failed and on_failure is null, or the key's variable is unset.
        """
        if not self.opened:
            self.open(0)
        cfg = self.cfg
        references = references if references is not None else [None] * len(answers)
        bodies = [request_body(cfg, render_messages(cfg, q, a, r)) for q, a, r in zip(questions, answers, references)]
        keys = [request_key(cfg, b) for b in bodies]
        todo = {k: b for k, b in zip(keys, bodies) if k not in self.cache}
        headers = self._headers() if todo else {}
        with ThreadPoolExecutor(max_workers=min(self.workers, max(1, len(todo)))) as pool:
            outcomes = dict(zip(todo, pool.map(lambda body: self._post(body, headers), todo.values())))
        stats = JudgeStats(
            requests=len(todo),
            cache_hits=len(keys) - len(todo),
            attempts=sum(o.attempts for o in outcomes.values()),
            seconds=sum(o.seconds for o in outcomes.values()),
        )
        judged: dict[str, tuple[Optional[float], Optional[str]]] = {}  # key -> (score, why none)
        for k in keys:
            outcome = outcomes.get(k)
            if outcome is not None and outcome.reply is None:
                judged[k] = (None, outcome.error)
            elif k not in judged:
                judged[k] = reply_score(outcome.reply if outcome is not None else self.cache[k][1], cfg)
        failed = {k: why for k, (score, why) in judged.items() if score is None}
        self._remember({k: (tag, o.reply) for k, o in outcomes.items() if k not in failed})
        if failed:
            first = next(iter(failed.values()))
            if cfg.on_failure is None:
                raise JudgeError(
                    f"judge: {len(failed)} of {len(judged)} requests to {cfg.base_url} failed (first: {first}); "
                    f"set judge.on_failure to a fallback score to train through failures"
                )
            log.warning(
                "judge: %d of %d requests failed (first: %s); they score judge.on_failure = %s",
                len(failed),
                len(judged),
                first,
                cfg.on_failure,
            )
        scores = [cfg.on_failure if k in failed else judged[k][0] for k in keys]
        stats.failures = sum(1 for k in keys if k in failed)
        for value, gold, k in zip(scores, golds or [], keys):
            if gold is not None and k not in failed:
                stats.judged_gold += 1
                stats.agree += int((value >= cfg.pass_score) == bool(gold))
        self.pending.add(stats)
        self.totals.add(stats)
        return [float(v) for v in scores]

    def take_figures(
        self, prefix: str = "judge/", total: Optional[Callable[[dict[str, float]], dict[str, float]]] = None
    ) -> dict[str, float]:
        """The counts since the last call as tracker figures, then reset: requests, cache_hits,
        failures (completions that got on_failure), latency_s (mean per request, retries included;
        0 when the cache answered everything) and, with gold_column, gold_agreement (NaN when every
        request failed). `total` sums the raw counts over ranks (every rank calls it at the same
        point): the figures are then the whole step's, each rank asking for its own completions."""
        s, self.pending = self.pending, JudgeStats()
        counts = {name: float(getattr(s, name)) for name in s.__dataclass_fields__}
        if total is not None:
            counts = total(counts)
        out = {f"{prefix}{name}": counts[name] for name in ("requests", "cache_hits", "failures")}
        out[f"{prefix}latency_s"] = counts["seconds"] / counts["requests"] if counts["requests"] else 0.0
        if self.cfg.gold_column:
            judged = counts["judged_gold"]
            out[f"{prefix}gold_agreement"] = counts["agree"] / judged if judged else math.nan
        return out


def ppo_reward_fn(judge: JudgeReward, tokenizer, step: Callable[[], int] = lambda: 0):
    """PPO's `reward_fn(prompt_texts, response_ids) -> [B]` (stages/ppo.py's constructor hook) scored
    by the judge. PPO hands a reward_fn the prompt as the chat template rendered it, not the record,
    so the judge sees that text as {question} and no reference or gold column; `step()` gives the
    cache tag (the stage's optimizer step + 1)."""
    import torch

    def reward(prompt_texts: Sequence[str], response_ids: Sequence[Sequence[int]]):
        answers = [tokenizer.decode(list(r), skip_special_tokens=True) for r in response_ids]
        return torch.tensor(judge.score(list(prompt_texts), answers, tag=step()))

    return reward
