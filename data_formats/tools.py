"""Tool-calling conversations: reading calls and tool lists, and Relay's default tool layout.

Records (both common shapes, read by data_formats.formats.lists):
  ShareGPT (LLaMA-Factory, MedicalGPT): a `function_call` turn whose value is the JSON call
      {"name", "arguments"} (or a list of them, parallel calls), an `observation` turn holding the
      tool's result, and `tools`: the tool schemas as a JSON string or a list.
  OpenAI messages (TRL, transformers chat templates): an assistant message with `tool_calls`
      [{"type": "function", "id"?, "function": {"name", "arguments"}}] (arguments a JSON object or
      its JSON text), a `tool` message with the result (`tool_call_id` optional), and `tools`.
A call becomes an assistant Turn with `tool_calls` [{"name", "arguments": dict, "id"?}]; a result
becomes a Turn of role 'tool'; the schemas become `Conversation.tools` (each the function object,
{"name", "description"?, "parameters"?}).

What is trained: the assistant's calls and its answers, each with its end-of-turn token; tool
results, the tool schemas and the user's turns never (data_formats.render).

How a tool conversation is rendered:
  native   the tokenizer's own chat template when it renders tools and calls (Qwen2.5, Llama 3.1
           style: `supports_tools`): the messages (`template_messages`) and `tools` are passed to
           `apply_chat_template` as transformers documents.
  layout   otherwise, and always in role_markers mode: Relay's default layout, which turns the
           conversation into plain system/user/assistant turns (`layout_turns`):
             - the tool schemas go at the end of the system turn (a system turn made of them when
               there is none), one JSON object per line inside <tools></tools>, after TOOLS_INTRO;
             - an assistant call is its text (if any) and a newline, then one line per call
               `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
             - consecutive tool results are one user turn, one `<tool_response>...</tool_response>`
               line each.
           The saved chat template (`layout_jinja` in front of the training template, see
           data_formats.render.template_jinja) does the same conversion in Jinja, so inference with
           `apply_chat_template(messages, tools=...)` renders exactly what training saw.
Reading calls back from generated text (`parse_answer`: GRPO/PPO tool rollouts, `relay serve`,
`relay chat`) uses the same call rules as reading them from records, on `<tool_call>...</tool_call>`
blocks (the layout's, and Hermes/Qwen2.5 native templates'); a template that writes calls another
way is refused where calls must be read back (pipeline/algorithms/tool_rollout.layout_problem).

JSON is written as `json.dumps(value, ensure_ascii=False)`, which is what transformers' `tojson`
filter writes, so both sides print the same bytes (call arguments given to the saved template as
JSON text, as OpenAI clients send them, are printed as given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Optional

from data_formats.conversation import Turn, json_type

TOOLS_INTRO = (
    "You can call the tools below (one JSON schema per line). To call tools, answer with one "
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call> line per call; each result comes '
    "back in a <tool_response></tool_response> line."
)


class ToolRecordError(ValueError):
    """A malformed tool call or tool list; data_formats.formats.lists re-raises it as a RecordError."""


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _json_value(value: Any, what: str) -> Any:
    """`value`, or the JSON it holds when it is a string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise ToolRecordError(f"{what} is not valid JSON: {err.msg} (column {err.colno})") from None
    return value


def parse_tools(value: Any) -> list[dict]:
    """The tool schemas of a record's `tools` field (a JSON string or a list), each the function
    object; an OpenAI entry {"type": "function", "function": {...}} gives its function.

    Raises:
        ToolRecordError: not a list of objects with a string `name`.
    """
    tools = _json_value(value, "field 'tools'")
    if not isinstance(tools, list):
        raise ToolRecordError(f"field 'tools' must be a list of tool schemas, got {json_type(tools)}")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool = tool["function"]
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"].strip():
            raise ToolRecordError(f"tools[{i}]: a tool must be an object with a 'name'")
        out.append(tool)
    return out


def _call(value: Any, where: str) -> dict:
    """One call {"name", "arguments": dict, "id"?} from {"name", "arguments"} or OpenAI's
    {"type": "function", "id", "function": {"name", "arguments"}}. Both `name` and `arguments` are
    required, as in OpenAI's tool calls (a call without arguments gives `{}`) and as vLLM's hermes
    parser reads them.

    Raises:
        ToolRecordError: not an object, or without its name or its arguments as a JSON object.
    """
    if not isinstance(value, dict):
        raise ToolRecordError(f"{where}: a tool call must be an object, got {json_type(value)}")
    function = value.get("function", value)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        raise ToolRecordError(f"{where}: a tool call needs a 'name'")
    if "arguments" not in function:
        raise ToolRecordError(f"{where}: a tool call needs its 'arguments' (a JSON object; {{}} when it takes none)")
    arguments = _json_value(function["arguments"], f"{where}: 'arguments'")
    if not isinstance(arguments, dict):
        raise ToolRecordError(f"{where}: 'arguments' must be a JSON object, got {json_type(arguments)}")
    call = {"name": function["name"], "arguments": arguments}
    if isinstance(value.get("id"), str):
        call["id"] = value["id"]
    return call


def parse_calls(value: Any, where: str) -> list[dict]:
    """The calls of a ShareGPT `function_call` value or an OpenAI `tool_calls` list.

    Raises:
        ToolRecordError: not JSON, not a call or a non-empty list of calls.
    """
    calls = _json_value(value, where)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise ToolRecordError(f"{where}: expected a tool call or a non-empty list of them")
    return [_call(c, f"{where}[{i}]") for i, c in enumerate(calls)]


def has_tools(conv) -> bool:
    """Whether a conversation lists tools, calls one or holds a tool result."""
    return bool(conv.tools) or any(t.role == "tool" or t.tool_calls for t in conv.turns)


# ------------------------------------------------------------------------------------------
# Native rendering (the tokenizer's template)
# ------------------------------------------------------------------------------------------


def template_messages(turns) -> list[dict]:
    """The turns as the messages transformers' chat templates read (OpenAI's shape)."""
    out = []
    for turn in turns:
        message: dict = {"role": turn.role, "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = [
                {
                    "type": "function",
                    **({"id": c["id"]} if "id" in c else {}),
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in turn.tool_calls
            ]
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        out.append(message)
    return out


def template_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    """The tool schemas as transformers documents them for `apply_chat_template(tools=...)`."""
    return [{"type": "function", "function": tool} for tool in tools] if tools else None


_PROBE_TOOL = {"name": "relay_probe_tool", "description": "d", "parameters": {"type": "object", "properties": {}}}
_PROBE_ARG = "relay_probe_argument"
_PROBE_RESULT = "relay_probe_result"


def supports_tools(tokenizer, chat_template: str) -> bool:
    """Whether `chat_template` renders tool schemas, calls and results: a probe conversation with
    one tool, one call and its result must show the schema's name, the call's argument and the
    result (a template that ignores `tools` or `tool_calls`, as SmolLM2's, drops one of them)."""
    turns = [
        Turn("user", "u"),
        Turn("assistant", "", tool_calls=[{"name": _PROBE_TOOL["name"], "arguments": {_PROBE_ARG: 1}}]),
        Turn("tool", _PROBE_RESULT),
    ]
    try:
        text = tokenizer.apply_chat_template(
            template_messages(turns),
            tools=template_tools([_PROBE_TOOL]),
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001  (any template error means: no tool support)
        return False
    return text.count(_PROBE_TOOL["name"]) >= 2 and _PROBE_ARG in text and _PROBE_RESULT in text


# ------------------------------------------------------------------------------------------
# Relay's default layout
# ------------------------------------------------------------------------------------------


def tools_block(tools: list[dict]) -> str:
    """The text the layout appends to the system turn."""
    return TOOLS_INTRO + "\n<tools>\n" + "\n".join(_dumps(t) for t in tools) + "\n</tools>"


def call_text(content: str, calls: list[dict]) -> str:
    """An assistant call turn's text in the layout."""
    lines = [f"<tool_call>{_dumps({'name': c['name'], 'arguments': c['arguments']})}</tool_call>" for c in calls]
    return (content + "\n" if content else "") + "\n".join(lines)


def layout_turns(conv):
    """The conversation in Relay's default layout: plain system/user/assistant turns (see the
    module docstring); returned unchanged when it has no tools, calls or results."""
    if not has_tools(conv):
        return conv

    turns: list = []
    previous = None
    for turn in conv.turns:
        if turn.role == "tool":
            text = f"<tool_response>{turn.content}</tool_response>"
            if previous == "tool":  # consecutive results share one user turn
                turns[-1] = Turn("user", turns[-1].content + "\n" + text)
            else:
                turns.append(Turn("user", text))
        elif turn.tool_calls:
            turns.append(Turn("assistant", call_text(turn.content, turn.tool_calls), trained=turn.trained))
        else:
            turns.append(Turn(turn.role, turn.content, trained=turn.trained))
        previous = turn.role
    if conv.tools:
        block = tools_block(conv.tools)
        if turns[0].role == "system":
            turns[0] = Turn("system", turns[0].content + "\n\n" + block)
        else:
            turns.insert(0, Turn("system", block))
    return replace(conv, turns=turns, tools=None)


def jinja_string(text: str) -> str:
    """A Jinja string literal (JSON escaping is a subset Jinja's lexer decodes)."""
    return json.dumps(text, ensure_ascii=True)


def layout_jinja(default_system: Optional[str]) -> str:
    """Jinja that rewrites `messages` (and `tools`) into the layout's plain turns, to put in front
    of a template that renders plain turns. `default_system` is the system turn the training data
    added to conversations without one (data.system_prompt), which the tools block then follows."""
    default = "''" if default_system is None else jinja_string(default_system + "\n\n")
    intro = jinja_string(TOOLS_INTRO + "\n<tools>")
    return (
        "{%- set relay = namespace(out=[], results=[], block='', calls=[]) -%}"
        "{%- if tools -%}{%- set relay.block = " + intro + " -%}"
        "{%- for tool in tools -%}{%- set relay.block = relay.block + '\\n' + "
        "((tool['function'] if tool['function'] is defined else tool) | tojson) -%}{%- endfor -%}"
        "{%- set relay.block = relay.block + '\\n</tools>' -%}"
        "{%- if not messages or messages[0]['role'] != 'system' -%}"
        "{%- set relay.out = [{'role': 'system', 'content': "
        + default
        + " + relay.block}] -%}{%- endif -%}{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'tool' -%}"
        "{%- set relay.results = relay.results + ['<tool_response>' + m['content'] + '</tool_response>'] -%}"
        "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
        "{%- set relay.out = relay.out + [{'role': 'user', 'content': relay.results | join('\\n')}] -%}"
        "{%- set relay.results = [] -%}{%- endif -%}"
        "{%- elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] -%}"
        "{%- set relay.calls = [] -%}"
        "{%- for c in m['tool_calls'] -%}{%- set f = c['function'] if c['function'] is defined else c -%}"
        "{%- set args = f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) -%}"
        "{%- set relay.calls = relay.calls + ['<tool_call>{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' + "
        "args + '}</tool_call>'] -%}{%- endfor -%}"
        "{%- set relay.out = relay.out + [{'role': 'assistant', "
        "'content': ((m['content'] + '\\n') if m['content'] else '') + "
        "relay.calls | join('\\n')}] -%}"
        "{%- elif loop.first and m['role'] == 'system' and tools -%}"
        "{%- set relay.out = relay.out + [{'role': 'system', 'content': m['content'] + '\\n\\n' + relay.block}] -%}"
        "{%- else -%}{%- set relay.out = relay.out + [{'role': m['role'], 'content': m['content']}] -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- set messages = relay.out -%}"
    )


# ------------------------------------------------------------------------------------------
# Reading calls back from generated text (RL rollouts, `relay serve`, `relay chat`)
# ------------------------------------------------------------------------------------------

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The call tags: Relay's layout writes `<tool_call>{...}</tool_call>`, Hermes/Qwen2.5-style native
templates `<tool_call>\\n{...}\\n</tool_call>`; `parse_answer` reads both."""


@dataclass
class ParsedAnswer:
    """An assistant turn's text read back: its prose, its well-formed calls and why each other
    call could not be read (one line each)."""

    content: str
    calls: list[dict]
    errors: list[str]

    @property
    def has_calls(self) -> bool:
        """The turn tried to call a tool (well-formed or not): a rollout answers it with results."""
        return bool(self.calls or self.errors)


def parse_answer(text: str) -> ParsedAnswer:
    """The calls in generated assistant text, read as training data's calls are read (`_call`:
    the same name and arguments rules); the text outside the call tags is the content.

    Never raises: a call that is not JSON, not a call, or an open tag without its close is an
    error line (a tool rollout shows it to the model as the call's result)."""
    content, calls, errors = [], [], []
    rest = text
    while CALL_OPEN in rest:
        before, _, after = rest.partition(CALL_OPEN)
        content.append(before)
        body, closed, rest = after.partition(CALL_CLOSE)
        where = f"tool call {len(calls) + len(errors) + 1}"
        if not closed:
            errors.append(f"{where}: {CALL_OPEN} without {CALL_CLOSE}")
            rest = ""
            break
        try:
            calls.append(_call(_json_value(body.strip(), where), where))
        except ToolRecordError as err:
            errors.append(str(err))
    content.append(rest)
    return ParsedAnswer("".join(content).strip(), calls, errors)
