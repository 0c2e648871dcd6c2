"""Tool rollouts for the RL stages (GRPO, PPO): the policy may call Python tools while it answers.

A rollout samples an assistant turn with the stage's sampler (pipeline/rl/rollout.py,
every backend) until its end-of-turn token. When the turn holds calls (read by
`data_formats.tools.parse_answer`, the reader of training data's calls), Relay runs them, appends
the results as `tool` turns and inserts the text the chat template puts between that turn and the
next assistant opener (`data_formats.render.inserted_text`: the same rendering and tokenization as
training data, native template or Relay's layout), then samples the next turn; until a turn
without calls, `tools.max_turns`, or the response budget (`generation.max_new_tokens` tokens,
sampled and inserted together).

What trains: only the tokens the policy sampled, kept as sampled (token in, token out: the ids are
never decoded and re-encoded, which can give other ids). The inserted tokens (tool results,
template text) are attended to but masked out of the loss, the KL and the value targets
(`Rollout.response_mask` is 0 on them), and their log-probs are never read.

Each turn asks every live row for the budget it has left (`max_new_tokens` per row); a sampler on
an engine of its own (vLLM) reports the engine's log-prob of each sampled token
(`last_logprobs`), kept turn by turn as `Rollout.engine_logp` (NaN on inserted tokens), so the
train-inference mismatch is measured and corrected (pipeline/algorithms/mismatch.py) as for a
single-answer rollout.

Failures never stop a run: an unknown tool, arguments the function does not take, an exception, a
call past `tools.timeout`, a call that cannot be parsed, or one past `tools.max_tool_calls` each
becomes an error text the model sees as that call's result.

Where tools run: in the trainer's process, each call in its own daemon thread, waited for at most
`tools.timeout` seconds. Why not a worker process: a tool named "module:function" is usually a
small pure function (a calculator, a lookup), a thread starts in microseconds and takes any
arguments and results, while a process per call costs a Python start-up (or a fork of a process
holding CUDA, which is unsafe) and a pool would have to be restarted to stop a stuck call. The
price, which is what a user must not put in a tool: a thread cannot be killed, so a tool past its
limit keeps running (its result is dropped); a tool must not touch the model or CUDA, must not
draw from torch's or Python's global RNG (a resumed run would then sample differently; use a
`random.Random` of its own), must not hold the GIL in a long C call (it would stall the trainer),
must be thread-safe (a batch's calls run at once), and must not exit the process.
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from data_formats.conversation import Conversation, Turn
from data_formats.render import Template, inserted_text, render_segments
from data_formats.tools import ToolRecordError, parse_answer, parse_tools, template_messages
from pipeline.algorithms.mismatch import engine_logprob_matrix
from pipeline.algorithms.rewards import func_name, load_reward_func, reward_func_problem
from pipeline.config.policy import ToolsConfig
from pipeline.rl.generators import Generator
from pipeline.rl.rollout import Rollout, assemble_masked, cut_at_eos

log = logging.getLogger("relay.tool_rollout")


@dataclass(frozen=True)
class Tool:
    name: str
    func: Callable
    schema: dict
    """The function object the prompt shows: {"name", "description", "parameters"}."""


# ------------------------------------------------------------------------------------------
# Tools and their schemas
# ------------------------------------------------------------------------------------------


def derive_schema(func: Callable) -> dict:
    """The function object of `func` from its type hints and Google-style docstring (transformers'
    `get_json_schema`, what `apply_chat_template(tools=[func])` shows a model), without its
    'return' entry (an OpenAI client's schemas have none, so training prompts look like served ones).

    Raises:
        ValueError: the function lacks a docstring, a type hint or an argument's description.
    """
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(func)["function"]
    except Exception as err:  # noqa: BLE001  (transformers raises its own TypeError subclasses)
        raise ValueError(f"cannot read its schema from the signature and docstring ({err})") from None
    return {k: v for k, v in schema.items() if k != "return"}


def read_schemas(path: str) -> dict[str, dict]:
    """Tool schemas by name from a JSON file (a list of OpenAI tool entries or function objects).

    Raises:
        ValueError: unreadable, not JSON, or not a list of named schemas (one line, naming the file).
    """
    try:
        return {t["name"]: t for t in parse_tools(json.loads(Path(path).read_text(encoding="utf-8")))}
    except OSError as err:
        raise ValueError(f"{path}: cannot be read ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
    except ToolRecordError as err:
        raise ValueError(f"{path}: {err}") from None


def tools_problems(cfg: ToolsConfig, key: str = "tools") -> list[str]:
    """The problems of a tools section beyond its own `problems()` (the limits), one line each,
    before any model loads: each function's import (the reward functions' rules), its schema,
    duplicate names."""
    out: list[str] = []
    given: dict[str, dict] = {}
    if cfg.schemas is not None:
        try:
            given = read_schemas(cfg.schemas)
        except ValueError as err:
            out.append(f"{key}.schemas: {err}")
    names: list[str] = []
    for spec in cfg.funcs:
        problem = reward_func_problem(spec)
        if problem:
            out.append(f"{key}.funcs: {problem}")
            continue
        name = func_name(spec)
        names.append(name)
        if name not in given:
            try:
                derive_schema(load_reward_func(spec))
            except ValueError as err:
                out.append(f"{key}.funcs: {spec!r}: {err}; give its schema in {key}.schemas")
    out += [f"{key}.funcs: two tools are named {n!r}" for n in sorted({n for n in names if names.count(n) > 1})]
    return out


def load_tools(cfg: ToolsConfig) -> dict[str, Tool]:
    """The tools a config names, by function name (schemas given in `cfg.schemas` win).

    Raises:
        ValueError: see `tools_problems` (the stage reports those before it gets here).
    """
    given = read_schemas(cfg.schemas) if cfg.schemas else {}
    tools = {}
    for spec in cfg.funcs:
        func, name = load_reward_func(spec), func_name(spec)
        tools[name] = Tool(name, func, {**given[name], "name": name} if name in given else derive_schema(func))
    return tools


# ------------------------------------------------------------------------------------------
# Running calls
# ------------------------------------------------------------------------------------------


def result_text(value: Any) -> str:
    """A tool's return value as the text the model sees: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def _checked(call: dict, tools: dict[str, Tool]) -> tuple[Optional[Tool], Optional[str]]:
    """(the tool to run, None) or (None, the error text) for one parsed call."""
    tool = tools.get(call["name"])
    if tool is None:
        return None, f"error: unknown tool {call['name']!r} (the tools are: {', '.join(sorted(tools)) or 'none'})"
    try:
        inspect.signature(tool.func).bind(**call["arguments"])
    except TypeError as err:
        return None, f"error: bad arguments for {tool.name!r}: {err}"
    return tool, None


def run_calls(calls: Sequence[dict], tools: dict[str, Tool], timeout: float) -> list[str]:
    """Each call's result text, in order (`call_outcomes` without whether each failed)."""
    return [text for text, _ in call_outcomes(calls, tools, timeout)]


def call_outcomes(calls: Sequence[dict], tools: dict[str, Tool], timeout: float) -> list[tuple[str, bool]]:
    """Each call's (result text, whether it failed), in order: a failure is an unknown tool,
    arguments it does not take, an exception, or no result within the time; its text is the error
    the model sees. The calls run at once, each in its own daemon thread, and each is waited for at
    most `timeout` seconds from the start (module docstring)."""
    results: list[Optional[str]] = [None] * len(calls)
    failed = [False] * len(calls)
    threads: list[tuple[int, threading.Thread, str]] = []
    for i, call in enumerate(calls):
        tool, error = _checked(call, tools)
        if error is not None:
            results[i], failed[i] = error, True
            continue

        def work(i=i, tool=tool, arguments=call["arguments"]):
            try:
                results[i] = result_text(tool.func(**arguments))
            except BaseException as err:  # noqa: BLE001  (a tool's failure is the model's to see)
                results[i], failed[i] = f"error: {tool.name!r} raised {type(err).__name__}: {err}", True

        thread = threading.Thread(target=work, name=f"relay-tool-{tool.name}", daemon=True)
        thread.start()
        threads.append((i, thread, tool.name))
    deadline = time.monotonic() + timeout
    for i, thread, name in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive() or results[i] is None:
            results[i], failed[i] = f"error: {name!r} did not return within {timeout:g} s", True
    return [(str(r), f) for r, f in zip(results, failed)]


# ------------------------------------------------------------------------------------------
# The rollout
# ------------------------------------------------------------------------------------------


@dataclass
class ToolEnv:
    """What a tool rollout needs besides the sampler."""

    tokenizer: Any
    template: Template
    tools: dict[str, Tool]
    cfg: ToolsConfig
    eos_id: int
    pad_id: int
    max_new_tokens: int
    """The response budget: sampled and inserted tokens together."""


@dataclass
class _Row:
    prompt: list[int]
    conv: Conversation
    ids: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    calls: int = 0
    """Calls run (what tools.max_tool_calls counts)."""
    asked: int = 0
    """Calls answered with a result: run, or refused with an error text (over the limit, unreadable)."""
    failed: int = 0
    """Of `asked`, those answered with an error text."""
    done: bool = False
    finished: bool = False
    engine: Optional[list[float]] = field(default_factory=list)
    """The engine's log-prob of each of `ids` (NaN on inserted ones); None once a turn came
    without them (a sampler that reports none)."""


def prompt_conversation(sample: dict) -> Conversation:
    """The conversation a prompt sample was rendered from (data_formats.prompt_data.build_prompt_data)."""
    data = json.loads(sample["conversation"])
    return Conversation([Turn(**t) for t in data["turns"]], tools=data.get("tools"))


def _take_turn(
    row: _Row, sampled: list[int], env: ToolEnv, logprobs: Optional[Sequence[float]] = None
) -> Optional[dict]:
    """Append one sampled turn (and the engine's log-probs of it, when reported) to `row`; the
    parsed answer when its calls must run, else None (the row is then done).

    Raises:
        ValueError: the engine reported fewer log-probs than the turn has tokens.
    """
    ids, ended = cut_at_eos(sampled, [env.eos_id])
    if logprobs is None or row.engine is None:
        row.engine = None
    elif len(logprobs) < len(ids):
        raise ValueError(f"tool rollout: the engine gave {len(logprobs)} log-probs for a turn of {len(ids)} tokens")
    else:
        row.engine += [float(v) for v in logprobs[: len(ids)]]
    row.ids += ids
    row.trained += [1] * len(ids)
    text = env.tokenizer.decode(ids[:-1] if ended else ids, skip_special_tokens=False)
    parsed = parse_answer(text)
    if not ended or not parsed.has_calls:
        row.turns.append(Turn("assistant", text))
        row.done, row.finished = True, ended
        return None
    row.turns.append(Turn("assistant", parsed.content, tool_calls=parsed.calls or None))
    assistant_turns = sum(t.role == "assistant" for t in row.turns)
    if assistant_turns >= env.cfg.max_turns:  # no turn left to read results in
        row.done, row.finished = True, True
        return None
    return {"calls": parsed.calls, "errors": parsed.errors}


def _results(row: _Row, asked: dict, env: ToolEnv) -> list:
    """The calls `row` may still run (within max_tool_calls) and the error texts of the rest."""
    room = max(0, env.cfg.max_tool_calls - row.calls)
    run, over = asked["calls"][:room], asked["calls"][room:]
    row.calls += len(run)
    limit = f"error: the limit of {env.cfg.max_tool_calls} tool calls per rollout is reached"
    return (
        [("run", c) for c in run] + [("text", limit) for _ in over] + [("text", f"error: {e}") for e in asked["errors"]]
    )


def _insert(row: _Row, texts: list[str], env: ToolEnv) -> None:
    """Append the results' tool turns and the template's text up to the next assistant opener,
    or end the row when they do not leave a token of room in the budget."""
    turns = row.turns + [Turn("tool", t) for t in texts]
    try:
        text = inserted_text(Conversation(row.conv.turns + turns, tools=row.conv.tools), env.tokenizer, env.template)
    except ValueError as err:  # a template that cannot render this conversation: it ends here, not the run
        log.warning("tool rollout: %s; the completion ends at its call", err)
        row.done, row.finished = True, False
        return
    inserted = env.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(row.ids) + len(inserted) >= env.max_new_tokens:
        row.done, row.finished = True, False  # out of room: the conversation ends at the call
        return
    row.turns = turns
    row.ids += inserted
    row.trained += [0] * len(inserted)
    if row.engine is not None:
        row.engine += [float("nan")] * len(inserted)  # not the policy's tokens: no engine log-prob


class Refill:
    """The session of a generator that keeps no cache across calls: each turn samples from the
    whole conversation again (`hf`, a test's scripted generator). `last_logprobs`: the generator's
    own, when it reports them (an engine's log-prob of each returned token), else None."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self.last_logprobs: Optional[list[list[float]]] = None

    def generate(
        self, rows: Sequence[int], contexts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]
    ) -> list[list[int]]:
        """The generator's samples of `contexts`, each within its row's budget.

        Raises:
            ValueError: the generator's `last_logprobs` are not one list per row.
        """
        out = self.generator.generate(contexts, max_new_tokens=list(max_new_tokens))
        reported = getattr(self.generator, "last_logprobs", None) or None
        if reported is not None and len(reported) != len(out):
            raise ValueError(
                f"tool rollout: the generator reported log-probs for {len(reported)} rows, not its {len(out)}"
            )
        self.last_logprobs = reported
        return out


def open_session(generator: Generator, rows: int):
    """Where a rollout's turns are sampled: the generator's own session when it has one
    (`RelayGenerator.session` keeps each row's KV cache across turns, only the inserted ids are
    prefilled; `VLLMGenerator.session` syncs the policy into the server once for all turns), else
    `Refill`. A session may report `last_logprobs` after each call and may have a `close`."""
    make = getattr(generator, "session", None)
    session = make(rows) if callable(make) else None
    return session if session is not None else Refill(generator)


def tool_rollout(generator: Generator, samples: Sequence[dict], env: ToolEnv, copies: int = 1) -> Rollout:
    """`copies` tool-using completions of each prompt sample (consecutive), laid out for scoring:
    `response_mask` 1 on sampled tokens only; `conversations` each row's completion as messages;
    `tool_calls` each row's (calls answered, of them failed);
    `engine_logp` the engine's log-prob of each sampled token when the sampler reports them for
    every turn (NaN on inserted tokens), else None.

    Raises:
        ValueError: the sampler reported log-probs that do not match its samples.
    """
    rows = [_Row(list(s["prompt_ids"]), prompt_conversation(s)) for s in samples for _ in range(copies)]
    session = open_session(generator, len(rows))
    while True:
        live = [i for i, r in enumerate(rows) if not r.done]
        if not live:
            break
        sampled = session.generate(
            live, [rows[i].prompt + rows[i].ids for i in live], [env.max_new_tokens - len(rows[i].ids) for i in live]
        )
        reported = getattr(session, "last_logprobs", None) or [None] * len(live)
        live = [rows[i] for i in live]
        asked = [(row, _take_turn(row, ids, env, lp)) for row, ids, lp in zip(live, sampled, reported)]
        plans = [(row, _results(row, a, env)) for row, a in asked if a is not None]
        calls = [c for _, plan in plans for kind, c in plan if kind == "run"]
        outputs = iter(call_outcomes(calls, env.tools, env.cfg.timeout))
        for row, plan in plans:
            results = [next(outputs) if kind == "run" else (c, True) for kind, c in plan]
            row.asked += len(results)
            row.failed += sum(failed for _, failed in results)
            _insert(row, [text for text, _ in results], env)
    close = getattr(session, "close", None)  # a session that holds the engine awake (vLLM's sleep mode)
    if callable(close):
        close()
    rollout = assemble_masked(
        [r.prompt for r in rows],
        [r.ids for r in rows],
        [r.trained for r in rows],
        [r.finished for r in rows],
        env.pad_id,
        [template_messages(r.turns) for r in rows],
    )
    rollout.tool_calls = [(r.asked, r.failed) for r in rows]
    if all(r.engine is not None for r in rows):  # the engine's log-probs of every sampled token, NaN on inserted ones
        rollout.engine_logp = engine_logprob_matrix(
            rollout.responses, [r.engine for r in rows], rollout.response_mask.shape[1]
        )
    return rollout


# ------------------------------------------------------------------------------------------
# The layout check
# ------------------------------------------------------------------------------------------

_PROBE_CALL = {"name": "relay_probe", "arguments": {"x": 1, "text": 'a "quoted" value'}}


def layout_problem(tokenizer, template: Template) -> Optional[str]:
    """Why Relay could not read back the calls this template writes, or None: the rendering of a
    probe call turn, parsed by `parse_answer`, must give the call (Relay's layout always does; a
    native template must write Hermes/Qwen-style <tool_call> JSON, not e.g. Llama 3.1's bare JSON)."""
    probe = Conversation(
        [Turn("user", "u"), Turn("assistant", "", tool_calls=[_PROBE_CALL]), Turn("tool", "r")],
        tools=[{"name": "relay_probe", "description": "d", "parameters": {"type": "object", "properties": {}}}],
    )
    try:
        spans = [text for text, trained in render_segments(probe, tokenizer, template) if trained]
    except ValueError as err:
        return f"the chat template cannot render a tool call ({err})"
    text = spans[0][: -len(template.eos)] if spans and spans[0].endswith(template.eos) else "".join(spans)
    parsed = parse_answer(text)
    if parsed.calls != [_PROBE_CALL] or parsed.errors:
        return (
            f"the chat template writes tool calls as {text.strip()[:80]!r}, which Relay's call reader "
            '(<tool_call>{"name": ..., "arguments": {...}}</tool_call>) does not read back'
        )
    return None
