"""`relay chat` with tools: the schemas go to the folder's chat template (the layout the model was
trained with), the model's calls are read back by the reader of training data's calls
(`data_formats.tools.parse_answer`) and shown, and each result is either typed by the user
(`--tool-schemas FILE`: schemas only) or comes from running the tool (`--tools module:function`,
in a thread with a time limit, as GRPO's tool rollouts run them: pipeline/rl/tool_rollout.py).
The model then answers again, until an answer without calls or `MAX_TURNS` turns.

    relay chat --model outputs/grpo/merged --tools tests.tools_demo:add --prompt "What is 123456 + 654321?"
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from data_formats.tools import parse_answer
from pipeline.config import ToolsConfig
from pipeline.rl.tool_rollout import load_tools, read_schemas, run_calls, tools_problems

MAX_TURNS = 8
"""Most assistant turns one user message may take (calls included)."""


def call_line(call: dict) -> str:
    """A call as `relay chat` shows it: name(JSON arguments) (pure)."""
    return f"{call['name']}({json.dumps(call['arguments'], ensure_ascii=False)})"


def assistant_message(content: str, calls: list[dict]) -> dict:
    """The history message of an assistant turn (with its `tool_calls` when it called tools)."""
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
        ]
    return message


def results(
    calls: list[dict], errors: list[str], tools: Optional[dict], timeout: float, read: Callable[[str], str]
) -> list[str]:
    """Each call's result: the tool run (`tools`), or typed by the user; then an error text per
    call that could not be read."""
    if tools is not None:
        out = run_calls(calls, tools, timeout)
    else:
        out = [read(f"result of {call_line(c)}> ") for c in calls]
    return out + [f"error: {e}" for e in errors]


def answer_with_tools(
    answer: Callable[[list[dict]], str],
    history: list[dict],
    tools: Optional[dict],
    timeout: float = 10.0,
    read: Callable[[str], str] = input,
    show: Callable[[str], None] = print,
    cut: Callable[[], str] = lambda: "",
) -> str:
    """Answer the last user turn of `history`, running the model's calls until it answers without
    any (or MAX_TURNS); appends every turn to `history` and returns the final answer's text.
    `answer(messages)` is one model turn's raw text (special tokens dropped); `cut()` the line that
    says the turn just answered stopped at the token limit ('' otherwise), shown after the calls of
    a turn it cut short (a call cut before its close tag reads as unreadable); the caller shows it
    after the final answer."""
    for _ in range(MAX_TURNS):
        text = answer(history)
        marker = cut()
        parsed = parse_answer(text)
        if not parsed.has_calls:
            history.append(assistant_message(text, []))
            return text
        if parsed.content:
            show(f"bot> {parsed.content}")
        for call in parsed.calls:
            show(f"call> {call_line(call)}")
        for error in parsed.errors:
            show(f"call> (unreadable) {error}")
        if marker:
            show(marker)
        history.append(assistant_message(parsed.content, parsed.calls))
        for result in results(parsed.calls, parsed.errors, tools, timeout, read):
            show(f"tool> {result}")
            history.append({"role": "tool", "content": result})
    show(f"[stopped after {MAX_TURNS} turns that all called tools]")
    return ""


class ToolSetup:
    """The tools of a chat: their schemas (shown to the model) and, for `--tools`, the functions."""

    def __init__(self, schemas: list[dict], tools: Optional[dict], timeout: float):
        self.schemas, self.tools, self.timeout = schemas, tools, timeout


def tool_setup(funcs: Optional[list[str]], schemas_file: Optional[str], timeout: float) -> Optional[ToolSetup]:
    """The chat's tools from `--tools` / `--tool-schemas`, or None without either (checked before
    the model loads; whether its template renders tools is `serve_tools.tool_support_problem`).

    Raises:
        ValueError: a tool that cannot be loaded or an unreadable schema file (every problem, one line each).
    """
    if not funcs and not schemas_file:
        return None
    problems: list[str] = []
    if funcs:
        cfg = ToolsConfig(funcs=list(funcs), schemas=schemas_file, timeout=timeout)
        problems += [
            p.replace("tools.funcs", "--tools").replace("tools.schemas", "--tool-schemas")
            for p in cfg.problems() + tools_problems(cfg)
        ]
        if problems:
            raise ValueError("; ".join(problems))
        tools = load_tools(cfg)
        return ToolSetup([t.schema for t in tools.values()], tools, timeout)
    try:
        schemas = list(read_schemas(schemas_file).values())
    except ValueError as err:
        problems.append(f"--tool-schemas: {err}")
    if problems:
        raise ValueError("; ".join(problems))
    return ToolSetup(schemas, None, timeout)
