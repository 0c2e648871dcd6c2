"""`relay serve`'s batching: a worker thread gathers waiting requests into one generate() call.

Every request becomes `n` rows; the worker takes what is waiting (a short window after the first,
up to `max_batch` rows), runs ONE `generate` for all of them and hands each row's tokens to its
request as they come (on_token). A row ends at an EOS id, at its max_tokens, at a stop string,
when its request's time limit passes or its client goes away (on_token returns True), so a long
request never holds the short ones back beyond the step they share. A batch the engine fails on
runs again one request at a time, so the error reaches only the request it comes from.

A job asking for log-probs gets, for each of its tokens, the token's log-probability and the
`top_logprobs` most likely tokens' under the model's raw distribution (log-softmax of the logits
the engine hands `on_logits`, before temperature and top_p: vLLM's default `raw_logprobs`).

All generation goes through the name `generate`: Relay's decode engine
(`pipeline.modeling.decode.generate`, a static KV cache, one forward per token); tests patch it here.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from pipeline.modeling.decode import generate


class ChoiceText:
    """The text of one choice as its tokens arrive: what is safe to send now, and where a stop
    string ends it (OpenAI's answer stops before the stop string)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self.decode, self.stops = decode, list(stops)
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""

    def add(self, token: int) -> tuple[str, bool]:
        """(text to send now, True when a stop string was reached)."""
        self.ids.append(token)
        full = self.decode(self.ids)
        hits = [full.find(s) for s in self.stops if s in full]
        if hits:
            return self._advance(full[: min(hits)]), True
        hold = max([k for s in self.stops for k in range(1, len(s)) if full.endswith(s[:k])] or [0])
        safe = len(full) - hold
        while safe > self.sent and full[safe - 1] == "\ufffd":  # an incomplete UTF-8 sequence: wait for its end
            safe -= 1
        return self._advance(full[:safe]), False

    def flush(self) -> str:
        """The rest of the text when the choice ends without a stop string."""
        return self._advance(self.decode(self.ids))

    def _advance(self, text: str) -> str:
        new = text[self.sent :] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        self.text = text if len(text) >= len(self.text) else self.text
        return new


@dataclass
class Job:
    """One request waiting for (or in) a batch. `emit(event)` is called from the worker thread:
    ("delta", index, text), ("finish", index, reason), or ("error", status, message)."""

    prompt: list[int]
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    stops: list[str]
    deadline: float
    emit: Callable[[tuple], None]
    seed: Optional[int] = None
    logprobs: bool = False
    """Whether each choice's tokens' log-probs are kept (`steps`)."""
    top_logprobs: int = 0
    cancelled: bool = False
    completion_tokens: int = 0
    choices: list[ChoiceText] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    steps: list[list[tuple]] = field(default_factory=list)
    """With logprobs: per choice, (token text, logprob, [(top token text, logprob), ...]) per token,
    complete before the choice's finish event."""

    def open_rows(self) -> int:
        return self.n - sum(self.done)


def token_logprobs(
    logits: torch.Tensor, token: int, top: int, text: Callable[[int], str]
) -> tuple[str, float, list[tuple[str, float]]]:
    """(token's text, its logprob, the `top` most likely tokens' (text, logprob), most likely first)
    under log_softmax(logits) of one row's raw logits [V] (pure)."""
    logp = torch.log_softmax(logits.float(), -1)
    best = logp.topk(top) if top else None
    listed = zip(best.indices.tolist(), best.values.tolist()) if best is not None else ()
    return text(token), float(logp[token]), [(text(i), v) for i, v in listed]


class Batcher:
    """The worker thread: gathers Jobs, runs one generate call per batch of at most
    `slice_tokens` new tokens per row. Rows still going after a slice continue in the next batch
    (their prompt + what they have so far), beside requests that arrived meanwhile: a long answer
    delays a new request by at most one slice, never by its whole length."""

    def __init__(
        self,
        model,
        tokenizer,
        eos_ids: Sequence[int],
        pad_id: int,
        max_batch: int = 16,
        window: float = 0.02,
        slice_tokens: int = 32,
    ):
        self.model, self.tokenizer, self.eos_ids, self.pad_id = model, tokenizer, list(eos_ids), pad_id
        self.max_batch, self.window, self.slice_tokens = max_batch, window, slice_tokens
        self.waiting: "queue.Queue[Job]" = queue.Queue()
        self.carried: list[Job] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="relay-serve-batcher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def submit(self, job: Job) -> None:
        self.waiting.put(job)

    def _take(self) -> list[Job]:
        """The next batch, first come first served: jobs carried over (unfinished, or that did not
        fit), then what arrives within the window after an idle wait (no wait while work is in hand),
        up to max_batch rows. A request with a seed runs alone, so its sample is reproducible."""
        if not self.carried:
            try:
                self.carried.append(self.waiting.get(timeout=0.1))
            except queue.Empty:
                return []
            until = time.monotonic() + self.window
        else:
            until = time.monotonic()
        while sum(j.open_rows() for j in self.carried) < self.max_batch:
            try:
                self.carried.append(self.waiting.get(timeout=max(0.0, until - time.monotonic())))
            except queue.Empty:
                break
        if self.carried[0].seed is not None:
            return [self.carried.pop(0)]
        batch, rows = [], 0
        for job in list(self.carried):
            if job.seed is not None:
                continue
            if rows + job.open_rows() > self.max_batch:
                break
            batch.append(job)
            rows += job.open_rows()
            self.carried.remove(job)
        return batch

    def _run(self) -> None:
        while not self.stopping.is_set():
            batch = [j for j in self._take() if self._still_wanted(j)]
            if batch:
                self.carried[:0] = self._generate(batch)

    def _still_wanted(self, job: Job) -> bool:
        """False for a job whose client left or whose time is up (told so: the answer so far
        ends with "length", or 503 when it never started)."""
        if job.cancelled:
            return False
        if time.monotonic() <= job.deadline:
            return True
        if not job.choices:
            job.emit(("error", 503, "the request timed out waiting for the model (--request-timeout); try again"))
        for i, text in enumerate(job.choices):
            if not job.done[i]:
                rest = text.flush()
                if rest:
                    job.emit(("delta", i, rest))
                job.emit(("finish", i, "length"))
        return False

    def _generate(self, batch: list[Job]) -> list[Job]:
        """One slice of `batch`; returns its jobs still going (carried to the next batch). When
        generate fails, a batch of several requests runs again one request at a time, each from the
        tokens it has, so a failure reaches only the request it belongs to, never its neighbours."""
        try:
            self._slice(batch)
        except Exception as err:  # noqa: BLE001 - every waiting client gets the reason, the server stays up
            if len(batch) == 1:
                batch[0].emit(("error", 500, f"generation failed: {type(err).__name__}: {err}"))
                return []
            return [kept for job in batch if self._going(job) for kept in self._generate([job])]
        return [job for job in batch if self._going(job)]

    @staticmethod
    def _going(job: Job) -> bool:
        return not all(job.done) and not job.cancelled

    def _slice(self, batch: list[Job]) -> None:
        """One generate call of at most `slice_tokens` new tokens per open row of `batch`.

        Raises:
            Exception: whatever generate raised (the rows' tokens so far are kept in their choices).
        """
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        for job in batch:
            if not job.choices:
                job.choices, job.done = [ChoiceText(decode, job.stops) for _ in range(job.n)], [False] * job.n
                job.steps = [[] for _ in range(job.n)]
        rows = [(job, i) for job in batch for i in range(job.n) if not job.done[i]]
        step_logits: list[torch.Tensor] = []
        token_text = lambda i: self.tokenizer.decode([i])  # noqa: E731 - special tokens named, as vLLM does

        def on_logits(step: int, logits: torch.Tensor) -> None:
            step_logits[:] = [logits]

        def finish(row: int, reason: str, text: str = "") -> None:
            job, i = rows[row]
            if text:
                job.emit(("delta", i, text))
            job.emit(("finish", i, reason))
            job.done[i] = True

        def on_token(row: int, token: int) -> bool:
            job, i = rows[row]
            job.completion_tokens += 1
            if job.logprobs:
                job.steps[i].append(token_logprobs(step_logits[0][row], token, job.top_logprobs, token_text))
            if token in self.eos_ids:
                finish(row, "stop", job.choices[i].flush())
                return True
            text, stopped = job.choices[i].add(token)
            if stopped:
                finish(row, "stop", text)
                return True
            if text:
                job.emit(("delta", i, text))
            # the time limit and a gone client end a row as its length limit does; the engine would end
            # the row at max_new_tokens too, but only after the batch: the client hears it now
            if job.cancelled or time.monotonic() > job.deadline or len(job.choices[i].ids) >= job.max_new_tokens:
                finish(row, "length", job.choices[i].flush())
                return True
            return False

        seed = batch[0].seed
        generator = torch.Generator(device=next(self.model.parameters()).device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
        generate(
            self.model,
            [job.prompt + job.choices[i].ids for job, i in rows],
            max_new_tokens=[min(self.slice_tokens, job.max_new_tokens - len(job.choices[i].ids)) for job, i in rows],
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            temperature=[job.temperature for job, _ in rows],
            top_p=[job.top_p for job, _ in rows],
            generator=generator,
            on_token=on_token,
            on_logits=on_logits if any(job.logprobs for job in batch) else None,
        )
