"""`relay serve`'s tool calling: the prompt, forcing a call, and reading calls back from answers.

One layout everywhere: the prompt is the model folder's own chat template given the request's
`tools` (a Relay model trained on tool data saved the layout it was trained with into that
template, data_formats.render.template_jinja), and an answer's calls are read by the reader of
training data's calls (`data_formats.tools.parse_answer`). So a model answers a served tool
conversation exactly as it saw tool conversations in training.

tool_choice:
  auto      the answer is read for calls; text without them is the content.
  none      the tools are still shown (as OpenAI does); the answer is never read for calls.
  required  the answer is started with the template's call opener (`<tool_call>`), so it is a call.
  a name    the answer is started with the opener and the call's name, up to its arguments.
Forcing is done by prefilling the answer with what the template writes before those parts of a
probe call (`call_prefix`); the model writes the rest. If what it writes is not a well-formed call
(a model never trained on tools), the answer is returned as content with its own finish reason,
never repaired.

Streaming: content is streamed as it comes until a call opener appears (text that could be the
start of one is held back); the calls are then sent when the answer ends, as OpenAI streams them:
for each call a delta with its index, id, type and name (arguments ""), then one with its
arguments; the finish reason is "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from typing import Optional

from data_formats.tools import CALL_OPEN, parse_answer, supports_tools, template_tools
from pipeline.tools.openai_protocol import ApiError, ChatRequest

_PROBE_ARGUMENTS = {"relay_probe_argument": 1}
NOT_TRAINED = (
    "this model's chat template does not render tools and tool calls; train it on tool conversations "
    "with Relay (the tool layout is saved into its template) or serve a model whose template has tools"
)


def tool_support_problem(tokenizer) -> Optional[str]:
    """Why the folder's template cannot serve tool requests, or None."""
    template = tokenizer.chat_template
    return None if template and supports_tools(tokenizer, template) else NOT_TRAINED


def _render(tokenizer, messages: list[dict], tools: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=template_tools(tools), add_generation_prompt=generation_prompt, tokenize=False
    )


def call_prefix(tokenizer, messages: list[dict], tools: list[dict], name: Optional[str]) -> tuple[str, int]:
    """(the answer the template writes for a probe call, where forcing may cut it): the cut is after
    the call opener, or (for a named tool) before the call's arguments.

    Raises:
        ApiError: the template does not write calls in a form Relay can start (400).
    """
    call = {"type": "function", "function": {"name": name or "relay_probe_tool", "arguments": _PROBE_ARGUMENTS}}
    prompt = _render(tokenizer, messages, tools, True)
    full = _render(tokenizer, messages + [{"role": "assistant", "content": "", "tool_calls": [call]}], tools, False)
    body = full[len(prompt) :] if full.startswith(prompt) else ""
    marker = json.dumps(_PROBE_ARGUMENTS) if name else CALL_OPEN
    at = body.find(marker)
    if at < 0:
        raise ApiError(
            400,
            "tool_choice: this model's chat template does not write calls in a form this server can force "
            "(use tool_choice 'auto')",
            "tool_choice",
            "unsupported_value",
        )
    return body, at if name else at + len(CALL_OPEN)


def token_prefix(tokenizer, body: str, cut: int) -> list[int]:
    """The ids of `body` tokenized on its own (as training tokenizes an answer) up to the last token
    that ends by `cut`: a prefill that stops inside a token (`"arguments": ` where training has
    `":` then ` {"`) would show the model a sequence it never saw."""
    encoded = tokenizer(body, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"][: sum(1 for end in ends if end <= cut)])


def prompt_and_prefill(tokenizer, request: ChatRequest) -> tuple[list[int], str]:
    """(prompt ids, the text the answer is started with) of a request with tools. The prompt is
    tokenized as training tokenizes it, and a forced answer's start as training tokenizes an answer,
    on the tokens' own boundaries. (The start is the server's text, not sampled: its tokens count as
    the prompt's in `usage`, and have no logprobs.)

    Raises:
        ApiError: the template cannot render tools, or cannot be forced to call (400).
    """
    problem = tool_support_problem(tokenizer)
    if problem:
        raise ApiError(400, problem, "tools", "unsupported_value")
    # The template already writes any BOS it wants; adding special tokens again would double it.
    ids = tokenizer(_render(tokenizer, request.messages, request.tools, True), add_special_tokens=False)["input_ids"]
    if request.tool_choice not in ("required", "function"):
        return ids, ""
    body, cut = call_prefix(tokenizer, request.messages, request.tools, request.tool_name)
    forced = token_prefix(tokenizer, body, cut)
    return ids + forced, tokenizer.decode(forced)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls as an OpenAI message's `tool_calls` (arguments as JSON text)."""
    return [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for c in calls
    ]


def answer_message(text: str, reason: str) -> tuple[dict, str]:
    """(the assistant message, finish reason) of a whole answer read for calls: with calls, their
    `tool_calls`, the text outside them as content (null when empty) and "tool_calls"; without,
    or where any call in it cannot be read (not JSON, no close tag: vLLM's hermes parser does the
    same), the whole text as content and `reason`, so nothing the model wrote is dropped."""
    parsed = parse_answer(text)
    if not parsed.calls or parsed.errors:
        return {"role": "assistant", "content": text}, reason
    return {
        "role": "assistant",
        "content": parsed.content or None,
        "tool_calls": openai_calls(parsed.calls),
    }, "tool_calls"


class CallStream:
    """One streamed choice of a request read for calls: `add` gives the content to send now,
    `finish` the last deltas and the finish reason (see the module docstring)."""

    def __init__(self, prefill: str):
        self.text, self.sent = prefill, 0

    def add(self, delta: str) -> str:
        self.text += delta
        at = self.text.find(CALL_OPEN)
        if at < 0:  # hold back what may be the start of a call opener, and trailing whitespace before one
            hold = max([k for k in range(1, len(CALL_OPEN)) if self.text.endswith(CALL_OPEN[:k])] or [0])
            at = len(self.text[: len(self.text) - hold].rstrip())
        else:
            at = len(self.text[:at].rstrip())
        out = self.text[self.sent : at] if at > self.sent else ""
        self.sent = max(self.sent, at)
        return out

    def finish(self, reason: str) -> tuple[list[dict], str]:
        """The deltas after the last `add`: the content not sent yet (with calls, what the whole
        answer's content has beyond what was streamed: text after a call too), then each call."""
        message, reason = answer_message(self.text, reason)
        if "tool_calls" not in message:
            rest = self.text[self.sent :]
            return ([{"content": rest}] if rest else []), reason
        content, streamed = message["content"] or "", self.text[: self.sent].strip()
        rest = content[len(streamed) :] if content.startswith(streamed) else ""
        deltas = [{"content": rest}] if rest else []
        for k, call in enumerate(message["tool_calls"]):
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": k,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""},
                        }
                    ]
                }
            )
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call["function"]["arguments"]}}]})
        return deltas, reason


def vllm_tool_flags(folder: str) -> list[str]:
    """vLLM's flags for tool calling on a model folder: its `hermes` parser (which reads
    `<tool_call>{json}</tool_call>`, the layout Relay trains and the Hermes/Qwen2.5 one) when the
    folder's template renders tools and writes calls that way; none otherwise (vLLM then refuses
    `tools`, as a model that never saw them should be)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tool_support_problem(tokenizer):
        return []
    try:
        body, cut = call_prefix(
            tokenizer, [{"role": "user", "content": "u"}], [{"name": "relay_probe_tool"}], "relay_probe_tool"
        )
        prefix = body[:cut]
    except ApiError:
        return []
    opener = json.dumps({"name": "relay_probe_tool", "arguments": 1})[: -len("1}")]
    if not prefix.endswith((CALL_OPEN + opener, CALL_OPEN + "\n" + opener)):
        return []
    return ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
