"""The common types every record format is read into, and the checks every format shares.

A record becomes one `Conversation` (SFT, prompts), a `Pair` of answers to one prompt (preference
data) or a text (PT); the formats that read records live in data_formats.formats, one module per
family behind one registry, and this module imports none of them. Parsing never repairs anything:
a record that does not fit its format raises `RecordError` with a one-line reason, which the
validator turns into `FILE:LINE: reason`.

Refused with one line saying why and what to do, whatever the kind: records with images, audio or
video (a text-only trainer would train on the placeholders), LLaMA-Factory's unfilled identity
placeholders ({{name}}, {{author}}) and LLaMA-Factory's dataset_info.json registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

ROLES = ("system", "user", "assistant", "tool")
MEDIA_FIELDS = ("images", "audios", "videos")
PLACEHOLDERS = ("{{name}}", "{{author}}")
REGISTRY_KEYS = ("file_name", "hf_hub_url", "ms_hub_url", "script_url", "om_hub_url")


class RecordError(ValueError):
    """A record that does not fit its format; the message is the one-line reason."""


@dataclass
class Turn:
    role: str
    """'system', 'user', 'assistant' or 'tool' (a tool's result)."""
    content: str
    tool_calls: Optional[list[dict]] = None
    """An assistant turn's tool calls [{"name", "arguments": dict, "id"?}] (data_formats.tools)."""
    tool_call_id: Optional[str] = None
    """A tool turn's call id, when the record gives one."""
    trained: bool = True
    """Whether an assistant turn is trained (False: OpenAI's `weight` 0, kept as context only)."""


@dataclass
class Conversation:
    turns: list[Turn]
    task: str = "default"
    """Task name: the record's data_name if present, else the data path entry's name."""
    source: str = ""
    """Where the record came from, as 'file:line'."""
    meta: dict = field(default_factory=dict)
    """Extra record fields a stage may need (e.g. a prompt record's answer for reward functions)."""
    tools: Optional[list[dict]] = None
    """The tool schemas the conversation may call (data_formats.tools)."""
    standard: bool = False
    """A prompt record that gave its prompt as a plain text (TRL's standard type, not messages):
    GRPO's reward functions then get the prompt and completions as strings, as TRL passes them."""


@dataclass
class Pair:
    """The two sides of a preference record, each the whole conversation up to its answer."""

    chosen: list[Turn]
    rejected: list[Turn]
    shared: Optional[tuple[str, str]] = None
    """The fields of two sides that each hold the whole conversation: their prompts must then agree
    (`check_shared_prompt`); None when the record gives the prompt once."""
    tools_from: Optional[dict] = None
    """The object whose `tools` field lists the schemas, when it is not the record itself (OpenAI's
    `input`)."""


JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "true or false", type(None): "null"}


def json_type(value: Any) -> str:
    """What a value read from JSON is, in JSON's words (an object, an array, null, a number, ...):
    what a record's problem says it got."""
    return JSON_TYPES.get(type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


def task_of(record: Any, default: str) -> str:
    """The task a record belongs to: its `data_name` when it has one (a non-empty string), else
    `default` (the data path entry's name).

    Raises:
        RecordError: a `data_name` that is not a non-empty string (the record would silently join
            the entry's own task).
    """
    if not isinstance(record, dict) or "data_name" not in record:
        return default
    name = record["data_name"]
    if not isinstance(name, str) or not name.strip():
        raise RecordError(f"field 'data_name' must be a task name (a non-empty string), got {name!r}")
    return name


def string_field(record: dict, key: str, *, allow_empty: bool = False) -> str:
    """`record[key]`, a string that is not blank unless `allow_empty`.

    Raises:
        RecordError: missing, not a string, or blank.
    """
    if key not in record:
        raise RecordError(f"missing field '{key}'")
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(f"field '{key}' must be a string, got {json_type(value)}")
    if not allow_empty and not value.strip():
        raise RecordError(f"field '{key}' is empty")
    return value


def media_refusal(what: str) -> RecordError:
    """The refusal of a multimodal record (`what`: the field or part that holds the media)."""
    return RecordError(
        f"multimodal record ({what}): Relay trains text-only language models; remove the media and their "
        "<image>/<audio>/<video> placeholders, or train this data with a multimodal trainer"
    )


def refuse_unsupported(record: dict) -> None:
    """Refuse what Relay cannot train whatever the kind (see the module docstring).

    Raises:
        RecordError: images/audio/video fields, or LLaMA-Factory's dataset registry.
    """
    for key in MEDIA_FIELDS:
        if record.get(key):
            raise media_refusal(f"field '{key}'")
    if record and all(isinstance(v, dict) and any(k in v for k in REGISTRY_KEYS) for v in record.values()):
        raise RecordError(
            "this is LLaMA-Factory's dataset registry (dataset_info.json), not training records: "
            "point Relay at the data files it names"
        )


def record_system(record: dict, turns: Sequence[Turn] = ()) -> list[Turn]:
    """`turns` (a record's message list) after the record's top-level `system` string
    (LLaMA-Factory's system column) as the first turn; null or blank: no system turn. When the list
    opens with its own system turn, that turn is the conversation's (LLaMA-Factory's system tag
    overrides the column), and a `system` field beside it must say the same.

    Raises:
        RecordError: a `system` that is not a string, or one that differs from the list's system turn.
    """
    value = record.get("system")
    if value is None or (isinstance(value, str) and not value.strip()):
        return list(turns)
    if not isinstance(value, str):
        raise RecordError(f"field 'system' must be a string, got {json_type(value)}")
    if turns and turns[0].role == "system":
        if turns[0].content != value:
            raise RecordError(
                f"two system prompts: field 'system' ({_excerpt(value)}) and the list's system turn "
                f"({_excerpt(turns[0].content)}) differ; keep one (LLaMA-Factory trains the list's and drops the field)"
            )
        return list(turns)
    return [Turn("system", value), *turns]


def _excerpt(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def history_turns(record: dict) -> list[Turn]:
    """A record's earlier rounds: `history`, a list of [instruction, response] string pairs
    (LLaMA-Factory's alpaca history column, MedicalGPT's reward records).

    Raises:
        RecordError: a history that is not such a list.
    """
    history = record.get("history")
    if history in (None, []):
        return []
    if not isinstance(history, list):
        raise RecordError(f"field 'history' must be a list of [instruction, response] pairs, got {json_type(history)}")
    turns = []
    for i, pair in enumerate(history):
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(x, str) and x.strip() for x in pair):
            raise RecordError(
                f"history[{i}]: must be an [instruction, response] pair of non-empty strings, got {pair!r}"
            )
        turns += [Turn("user", pair[0]), Turn("assistant", pair[1])]
    return turns


# After each role, the roles that may follow it (an assistant turn that calls tools: its results).
_NEXT = {"user": ("assistant",), "assistant": ("user",), "tool": ("tool", "assistant")}


def check_order(turns: list[Turn], last: str) -> None:
    """Check the role order: an optional system turn first, then user and assistant alternating,
    starting with user and ending with `last` ('assistant' or 'user'); an assistant turn that calls
    tools is followed by their results (tool turns), one per call in the calls' order
    (`check_results`), which are followed by the assistant's turn. A prompt (`last` 'user') may
    also end with tool results.

    Raises:
        RecordError: the first turn that breaks the order.
    """
    body = turns
    if turns and turns[0].role == "system":
        body = turns[1:]
    offset = len(turns) - len(body)
    for i, turn in enumerate(body):
        index = i + offset
        if turn.role == "system":
            raise RecordError(f"turn {index}: system turn must come first")
        if i == 0:
            if turn.role != "user" and not (turn.role == "assistant" and offset):  # OpenAI allows system, assistant
                raise RecordError(f"turn {index}: conversation must start with a user turn, got {turn.role}")
            continue
        previous = body[i - 1]
        allowed = ("tool",) if previous.tool_calls else _NEXT[previous.role]
        if turn.role in allowed:
            if previous.tool_calls:
                check_results(body, i - 1, offset)
            continue
        if previous.tool_calls:
            raise RecordError(
                f"turn {index}: a tool call must be followed by its result (a tool/observation turn), got {turn.role}"
            )
        if turn.role == "tool":
            raise RecordError(f"turn {index}: a tool result must follow the assistant's tool call")
        if previous.role == "tool":
            raise RecordError(f"turn {index}: a tool result must be followed by the assistant's turn, got {turn.role}")
        raise RecordError(f"turn {index}: two {turn.role} turns in a row")
    if not body:
        raise RecordError("conversation has no user turn")
    ends = (last, "tool") if last == "user" else (last,)
    if body[-1].role not in ends:
        raise RecordError(f"last turn must be the {last}'s, got {body[-1].role}")


def check_results(body: list[Turn], at: int, offset: int = 0) -> None:
    """Check the results that follow the tool calls of turn `at` (`offset`: the turns before
    `body`, for the turn numbers): one tool turn per call, the k-th answering the k-th call, as
    OpenAI's tool messages answer an assistant's tool_calls and as Relay's layout and the native
    templates show them (in order, without ids). Ids are optional; where the call has an `id` and
    its result a `tool_call_id`, they must be equal.

    Raises:
        RecordError: more or fewer results than calls, or a result whose id names another call.
    """
    calls = body[at].tool_calls or []
    results = []
    for turn in body[at + 1 :]:
        if turn.role != "tool":
            break
        results.append(turn)
    if len(results) != len(calls):
        raise RecordError(
            f"turn {at + offset}: {len(calls)} tool call(s) answered by {len(results)} result(s): give one "
            "tool/observation turn per call, in the calls' order"
        )
    for k, (call, result) in enumerate(zip(calls, results)):
        if "id" in call and result.tool_call_id is not None and result.tool_call_id != call["id"]:
            raise RecordError(
                f"turn {at + offset + 1 + k}: tool_call_id {result.tool_call_id!r} does not match call {k + 1} of "
                f"turn {at + offset} (id {call['id']!r}): results answer the calls one each, in the calls' order"
            )


def check_placeholders(turns: list[Turn]) -> None:
    """Refuse LLaMA-Factory's identity placeholders left unfilled (training would teach them).

    Raises:
        RecordError: a turn holds {{name}} or {{author}}.
    """
    for turn in turns:
        found = [p for p in PLACEHOLDERS if p in turn.content]
        if found:
            raise RecordError(
                f"unfilled placeholder {found[0]} (LLaMA-Factory's identity.json): replace {{{{name}}}} and "
                "{{author}} with your model's name and maker before training"
            )


def check_shared_prompt(chosen: list[Turn], rejected: list[Turn], chosen_key: str, rejected_key: str) -> None:
    """Check that two sides given as whole conversations ask the same question: equal up to and
    including their last user turn (what follows it is the answer, tool calls included). A pair
    whose sides differ there compares answers to different prompts, which no preference loss can
    learn from (TRL's `extract_prompt` would keep only their common opening as the prompt).

    Raises:
        RecordError: the first turn where the two prompts differ.
    """

    def prompt(turns: list[Turn]) -> list[Turn]:
        last_user = max((i for i, t in enumerate(turns) if t.role == "user"), default=-1)
        return turns[: last_user + 1]

    mine, theirs = prompt(chosen), prompt(rejected)
    if mine == theirs:
        return
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    raise RecordError(
        f"'{chosen_key}' and '{rejected_key}' differ at turn {at}, before the answer: the two sides of a "
        f"preference pair must share their prompt up to the last user turn (drop the record, or fix the side "
        f"that asks another question)"
    )
