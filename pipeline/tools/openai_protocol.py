"""The OpenAI chat-completions protocol as `relay serve` speaks it: request checking and the
response / stream-chunk objects (pure functions; the server is pipeline/tools/serve.py).

What clients send and what we answer follow the OpenAI API reference: content as a string or a
list of text parts, the `developer` role (the system turn of newer models), `n`, `stop` (a string
or up to 4), `max_tokens` / `max_completion_tokens`, `temperature` in [0, 2], `top_p` in (0, 1],
`stream` with `stream_options.include_usage`, `seed`, `logprobs` with `top_logprobs` (0 to
MAX_TOP_LOGPROBS; answered without streaming: each generated token's log-probability under the model's
raw distribution, before temperature and top_p, as vLLM's default `raw_logprobs` and OpenAI return
it), and tool calling: `tools` (function
schemas), `tool_choice` ('auto', the default with tools; 'none'; 'required'; or
{"type": "function", "function": {"name"}}), assistant messages with `tool_calls` (their
`content` may be null) and `tool` messages (with `tool_call_id`) in the history. A request we
cannot honour is refused with an OpenAI-style error, never silently changed:
{"error": {"message", "type", "param", "code"}}; a NaN or infinity (Python's json reads them) in any
field is refused naming it (`non_finite`). How calls are prompted, forced and read back from
the answer is pipeline/tools/serve_tools.py.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from data_formats.tools import ToolRecordError, parse_calls, parse_tools

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""OpenAI role -> the role the chat template is given (templates know system, not developer)."""
MAX_N = 8
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on `top_logprobs` (vLLM's default `--max-logprobs` too)."""
LOGPROB_FLOOR = -9999.0
"""The lowest log-probability written (vLLM's floor): -inf is not JSON."""
ACCEPTED_AND_UNUSED = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
"""Keys clients send that change nothing about the answer (bookkeeping on OpenAI's side)."""
NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
    "response_format": {"type": "text"},
}
"""Keys accepted only at their no-op value: anything else would be a promise we do not keep."""
TOOL_CHOICES = ("auto", "none", "required")
"""tool_choice's strings; {"type": "function", "function": {"name": ...}} names one tool."""


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked /v1/chat/completions request."""

    messages: list[dict]
    max_tokens: Optional[int]
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    seed: Optional[int] = None
    tools: list[dict] = field(default_factory=list)
    """The function objects of `tools` ({"name", "description"?, "parameters"?})."""
    tool_choice: str = "none"
    """'auto', 'none', 'required', or 'function' (the tool `tool_name` must be called)."""
    tool_name: Optional[str] = None
    logprobs: bool = False
    """Whether each choice carries its tokens' log-probabilities."""
    top_logprobs: int = 0
    """How many most likely tokens each of those lists beside it (with logprobs)."""

    @property
    def wants_calls(self) -> bool:
        """Whether the answer is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"


def non_finite(value: Any, path: str = "") -> Optional[tuple[str, float]]:
    """(where, what) of the first NaN or infinity in a decoded JSON value, or None (pure). Python's
    json reads NaN, Infinity and -Infinity, which JSON has no words for (the openai SDK refuses to
    send them); every comparison with NaN is False, so a range check alone lets it through."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)
        found = non_finite(item, where)
        if found is not None:
            return found
    return None


def _number(body: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"'{key}' must be a number, got {value!r}", key, "invalid_type")
    if value < low or value > high or (low_open and value == low):
        bounds = f"{'(' if low_open else '['}{low}, {high}]"
        raise ApiError(400, f"'{key}' must be in {bounds}, got {value}", key, "invalid_value")
    return float(value)


def _integer(body: dict, key: str, low: int, high: Optional[int] = None) -> Optional[int]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{key}' must be an integer, got {value!r}", key, "invalid_type")
    if value < low or (high is not None and value > high):
        raise ApiError(
            400, f"'{key}' must be in [{low}, {high if high is not None else 'inf'}], got {value}", key, "invalid_value"
        )
    return value


def message_text(content: Any, index: int) -> str:
    """The text of a message's content: a string, or a list of {"type": "text", "text": ...} parts.

    Raises:
        ApiError: another shape, or a part that is not text (images, audio).
    """
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(
                    400, f"{param}[{j}]: only text parts are supported (got {kind!r})", param, "invalid_content"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{param} must be a string or a non-empty list of text parts", param, "invalid_content")


def check_messages(messages: Any) -> list[dict]:
    """[{'role', 'content': str}] from the request's messages (roles mapped by ROLES), assistant
    calls as `tool_calls` [{"type", "id"?, "function": {"name", "arguments": dict}}] (the arguments'
    JSON text decoded, as training data's are) and a tool result's `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ApiError(
                400,
                f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r})",
                f"messages[{i}].role",
                "invalid_value",
            )
        out.append(
            _tool_message(m, i)
            if m["role"] == "tool" or m.get("tool_calls")
            else {"role": ROLES[m["role"]], "content": message_text(m.get("content"), i)}
        )
    return out


def _tool_message(m: dict, index: int) -> dict:
    """A `tool` message, or an assistant message with `tool_calls` (its content may be null)."""
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise ApiError(
                400,
                f"messages[{index}].tool_call_id: a tool message needs the id of the call it answers",
                f"messages[{index}].tool_call_id",
                "invalid_value",
            )
        return {"role": "tool", "content": message_text(m.get("content"), index), "tool_call_id": m["tool_call_id"]}
    if m["role"] != "assistant":
        raise ApiError(
            400,
            f"messages[{index}].tool_calls: only assistant messages carry tool calls",
            f"messages[{index}].tool_calls",
            "invalid_value",
        )
    param = f"messages[{index}].tool_calls"
    if not isinstance(m["tool_calls"], list) or any(
        not isinstance(c, dict) or c.get("type", "function") != "function" for c in m["tool_calls"]
    ):
        raise ApiError(
            400, f"{param} must be a list of {{'type': 'function', 'id', 'function'}} calls", param, "invalid_value"
        )
    try:
        calls = parse_calls(m["tool_calls"], param)
    except ToolRecordError as err:
        raise ApiError(400, str(err), param, "invalid_value") from None
    content = "" if m.get("content") is None else message_text(m["content"], index)
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {
                "type": "function",
                **({"id": c["id"]} if "id" in c else {}),
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ],
    }


def check_tools(body: dict) -> tuple[list[dict], str, Optional[str]]:
    """(function objects, tool_choice, the named tool) of a request's `tools` and `tool_choice`.

    Raises:
        ApiError: malformed tools; an unknown tool_choice, one naming a tool not listed, or one
            other than 'none' without tools (400).
    """
    tools: list[dict] = []
    if body.get("tools") is not None:
        if not isinstance(body["tools"], list) or any(
            not isinstance(t, dict) or t.get("type") != "function" for t in body["tools"]
        ):
            raise ApiError(
                400,
                "'tools' must be a list of {'type': 'function', 'function': {...}} objects",
                "tools",
                "invalid_value",
            )
        try:
            tools = parse_tools(body["tools"])
        except ToolRecordError as err:
            raise ApiError(400, str(err).replace("field 'tools'", "'tools'"), "tools", "invalid_value") from None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    named = (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    )
    if not named and choice not in TOOL_CHOICES:
        raise ApiError(
            400,
            f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or {{'type': 'function', 'function': "
            f"{{'name': ...}}}}, got {choice!r}",
            "tool_choice",
            "invalid_value",
        )
    if choice != "none" and not tools:
        raise ApiError(400, "'tool_choice' is only allowed when 'tools' are given", "tool_choice", "invalid_value")
    if choice != "none" and body.get("parallel_tool_calls") is False:  # a promise the answer's reader would not keep
        raise ApiError(
            400,
            "'parallel_tool_calls': false is not supported (an answer may hold several calls)",
            "parallel_tool_calls",
            "unsupported_value",
        )
    if not named:
        return tools, choice, None
    name = choice["function"]["name"]
    if name not in [t["name"] for t in tools]:
        raise ApiError(400, f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice", "invalid_value")
    return tools, "function", name


def check_request(body: Any, served_name: str) -> ChatRequest:
    """A ChatRequest from a request body (pure).

    Raises:
        ApiError: 400 for anything malformed or out of range (a NaN or infinity anywhere in it
            included), 404 for another model's name.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    known = {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "stop",
        "stream",
        "stream_options",
        "seed",
        "tools",
        "tool_choice",
        "logprobs",
        "top_logprobs",
        *ACCEPTED_AND_UNUSED,
        *NEUTRAL,
    }
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    # messages and tools hold no numbers of ours: their own checks name what is wrong there
    bad_number = non_finite({key: value for key, value in body.items() if key not in ("messages", "tools")})
    if bad_number is not None:  # before the range checks, which every comparison with NaN passes
        path, value = bad_number
        raise ApiError(400, f"'{path}' must be a finite number, got {json.dumps(value)}", path, "invalid_value")
    for key, neutral in NEUTRAL.items():
        if key in body and body[key] not in (neutral, None):
            raise ApiError(
                400, f"'{key}' is not supported by this server (only {neutral!r})", key, "unsupported_parameter"
            )
    if not isinstance(body.get("model"), str):
        raise ApiError(
            400, "'model' is required (a string; GET /v1/models lists it)", "model", "missing_required_parameter"
        )
    if body["model"] != served_name:
        raise ApiError(
            404,
            f"The model '{body['model']}' does not exist; this server serves '{served_name}'",
            "model",
            "model_not_found",
        )
    messages = check_messages(body.get("messages"))
    tools, tool_choice, tool_name = check_tools(body)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise ApiError(400, "give 'max_tokens' or 'max_completion_tokens', not both", "max_tokens", "invalid_value")
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop)
    ):
        raise ApiError(
            400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop", "invalid_value"
        )
    stream = body.get("stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(
            400,
            "'stream' must be a boolean and 'stream_options' at most {'include_usage': bool}",
            "stream",
            "invalid_value",
        )
    logprobs, top_logprobs = check_logprobs(body, stream)
    return ChatRequest(
        messages=messages,
        max_tokens=_integer(body, key, 1),
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", 1.0, 0, 1, low_open=True),
        n=_integer(body, "n", 1, MAX_N) or 1,
        stop=stop or [],
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def check_logprobs(body: dict, stream: bool) -> tuple[bool, int]:
    """(logprobs, top_logprobs) of a request, OpenAI's rules: `logprobs` a boolean, `top_logprobs`
    an integer in [0, MAX_TOP_LOGPROBS] that needs `logprobs: true`.

    Raises:
        ApiError: another type or range, top_logprobs without logprobs, or logprobs with `stream`
            (this server sends log-probs in whole answers only) (400).
    """
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise ApiError(400, f"'logprobs' must be a boolean, got {logprobs!r}", "logprobs", "invalid_type")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    if logprobs and stream:
        raise ApiError(
            400,
            "'logprobs' with 'stream': true is not supported by this server (ask without streaming)",
            "logprobs",
            "unsupported_parameter",
        )
    return bool(logprobs), top or 0


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def context_of(config) -> int:
    """Tokens a model reads at most, prompt and answer together (its config's max_position_embeddings;
    2048 where it has none): what a request, or a `relay chat` turn, must fit."""
    return int(getattr(config, "max_position_embeddings", None) or 2048)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_logprob(token: str, logprob: float) -> dict:
    """One {"token", "logprob", "bytes"} entry: the token's text, its log-probability (at least
    LOGPROB_FLOOR) and the UTF-8 bytes of that text (pure)."""
    return {"token": token, "logprob": max(float(logprob), LOGPROB_FLOOR), "bytes": list(token.encode("utf-8"))}


def logprobs_content(steps: list[tuple[str, float, list[tuple[str, float]]]]) -> dict:
    """A choice's `logprobs` object, {"content": [...]}, from (token, logprob, [(top token,
    logprob), ...]) per generated token (pure)."""
    return {
        "content": [
            {**token_logprob(token, lp), "top_logprobs": [token_logprob(t, v) for t, v in top]}
            for token, lp, top in steps
        ]
    }


def completion_response(
    cid: str,
    model: str,
    texts: list,
    reasons: list[str],
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: Optional[list[dict]] = None,
) -> dict:
    """An OpenAI chat.completion object with one choice per text, or per message (a dict: an
    answer with `tool_calls`, pipeline/tools/serve_tools.py), and each choice's `logprobs` object
    when given (`logprobs_content`) (pure)."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": t if isinstance(t, dict) else {"role": "assistant", "content": t},
                "logprobs": logprobs[i] if logprobs is not None else None,
                "finish_reason": r,
            }
            for i, (t, r) in enumerate(zip(texts, reasons))
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chunk(cid: str, model: str, index: int, delta: dict, finish_reason: Optional[str] = None) -> dict:
    """One chat.completion.chunk of a stream (pure)."""
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
