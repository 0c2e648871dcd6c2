"""The list formats: a record holding its conversation as one list of messages.

  messages    OpenAI:   {"messages": [{"role", "content"}]}; assistant `tool_calls`, role `tool`
              and `tools` (data_formats.tools); content may also be a list of text parts
              ({"type": "text", "text"|"value"}, LLaMA-Factory's v1 records, with a `loss_weight`
              per turn only where it says what Relay trains anyway: 1 on assistant turns, else 0)
  sharegpt    ShareGPT: {"conversations": [{"from", "value"}]}  (human/gpt; function_call and
              observation with `tools`, data_formats.tools)
Both take an optional top-level `system` string (LLaMA-Factory's system column). OpenAI's
per-message `weight` (0 or 1 on assistant messages) sets `Turn.trained`; a `developer` turn is a
system turn. Refused: image/audio/video content parts and reasoning parts.

The message reader here (`read_turns`, `record_tools`) is the one every format that holds
messages uses (MFTCoder's chat_rounds, TRL's message lists, OpenAI's preference records).
"""

from __future__ import annotations

from typing import Any, Optional

from data_formats.conversation import RecordError, Turn, json_type, media_refusal, record_system
from data_formats.tools import ToolRecordError, parse_calls, parse_tools

# Every spelling of a role we accept; anything else is an "unknown role" problem. ShareGPT's
# function_call is an assistant turn whose value is the call (data_formats.tools).
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system turn
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "bot": "assistant",
    "gpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
MEDIA_PARTS = ("image", "image_url", "audio", "audio_url", "input_audio", "video", "video_url")


def content_of(value: Any, where: str) -> tuple[str, list[dict]]:
    """(text, calls) of a turn's content: a string, null (a call without text), or a list of
    parts: text parts joined, v1 `tool_call` parts read as calls; anything else refused."""
    if value is None:
        return "", []
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise RecordError(f"{where}: content must be a string, got {json_type(value)}")
    texts, calls = [], []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise media_refusal(f"a '{kind}' content part")
        if kind == "reasoning":
            raise RecordError(
                "a 'reasoning' content part (LLaMA-Factory v1 reasoning data); Relay trains answers, not "
                "separate reasoning traces: drop the reasoning parts, or write them into the answer text"
            )
        text = part.get("text", part.get("value")) if isinstance(part, dict) else None
        if kind not in ("text", "tool_call") or not isinstance(text, str):
            raise RecordError(f"{where}: content part {j} is not a text part ({{'type': 'text', 'text': ...}})")
        if kind == "tool_call":
            calls += calls_of(text, f"{where}: content part {j}")
        else:
            texts.append(text)
    return "".join(texts), calls


def calls_of(value: Any, where: str) -> list[dict]:
    """The tool calls `value` holds (data_formats.tools.parse_calls), refused as a RecordError."""
    try:
        return parse_calls(value, where)
    except ToolRecordError as err:
        raise RecordError(str(err)) from None


def check_loss_weight(item: dict, role: str) -> None:
    """A v1 `loss_weight` is accepted only where it says what Relay trains anyway."""
    if "loss_weight" not in item:
        return
    want = 1.0 if role == "assistant" else 0.0
    if item["loss_weight"] != want:
        raise RecordError(
            f"loss_weight {item['loss_weight']!r} on a turn of the {role}; Relay trains every assistant "
            "turn (weight 1) and nothing else (weight 0): drop the field or the turn"
        )


def read_turn(item: Any, where: str, role_key: str, content_key: str) -> Turn:
    """One turn of a message list (see the module docstring).

    Raises:
        RecordError: the turn does not fit.
    """
    if not isinstance(item, dict):
        raise RecordError(f"{where}: a turn must be an object, got {json_type(item)}")
    if role_key not in item:
        raise RecordError(f"{where}: missing field '{role_key}'")
    raw_role = item[role_key]
    if not isinstance(raw_role, str) or raw_role.lower() not in ROLE_ALIASES:
        raise RecordError(f"{where}: unknown role {raw_role!r}")
    role = ROLE_ALIASES[raw_role.lower()]
    if content_key not in item and not (role == "assistant" and item.get("tool_calls")):  # OpenAI: a call may omit it
        raise RecordError(f"{where}: missing field '{content_key}'")
    check_loss_weight(item, role)
    if raw_role.lower() == "function_call":
        if not isinstance(item[content_key], str):
            raise RecordError(f"{where}: content must be a string, got {json_type(item[content_key])}")
        return Turn("assistant", "", tool_calls=calls_of(item[content_key], f"{where}: function_call"))
    content, calls = content_of(item.get(content_key), where)
    if item.get("tool_calls") and role == "assistant":
        calls += calls_of(item["tool_calls"], f"{where}: tool_calls")
    if calls and role != "assistant":
        raise RecordError(f"{where}: a {role} turn cannot call tools")
    if not calls and not content.strip():
        raise RecordError(f"{where}: empty content")
    call_id = item.get("tool_call_id") if role == "tool" and isinstance(item.get("tool_call_id"), str) else None
    return Turn(role, content, tool_calls=calls or None, tool_call_id=call_id, trained=weight_of(item, role, where))


def weight_of(item: dict, role: str, where: str) -> bool:
    """OpenAI's per-message `weight`: 1 trains an assistant message (the default), 0 keeps it as context."""
    if "weight" not in item:
        return True
    if role != "assistant" or item["weight"] not in (0, 1) or isinstance(item["weight"], bool):
        raise RecordError(
            f"{where}: 'weight' {item['weight']!r} on {'an' if role == 'assistant' else 'a'} {role} turn; "
            "OpenAI's weight is 0 or 1 on an assistant message (0: not trained)"
        )
    return item["weight"] == 1


def read_turns(items: Any, key: str, role_key: str, content_key: str) -> list[Turn]:
    """The turns of the message list `items` (record field `key`).

    Raises:
        RecordError: not a non-empty list, or a turn that does not fit.
    """
    if not isinstance(items, list):
        raise RecordError(f"field '{key}' must be a list of turns, got {json_type(items)}")
    if not items:
        raise RecordError(f"field '{key}' has no turns")
    return [read_turn(item, f"{key}[{i}]", role_key, content_key) for i, item in enumerate(items)]


def record_tools(record: dict) -> Optional[list[dict]]:
    """The record's tool schemas (`tools`), or None.

    Raises:
        RecordError: a malformed `tools` field.
    """
    value = record.get("tools")
    if value in (None, "", []):
        return None
    try:
        return parse_tools(value)
    except ToolRecordError as err:
        raise RecordError(str(err)) from None


def list_turns(record: dict, key: str, role_key: str, content_key: str) -> list[Turn]:
    """The turns of a record whose conversation is the message list `key` (after its `system`).

    Raises:
        RecordError: the list is missing or does not fit.
    """
    if key not in record:
        raise RecordError(f"missing field '{key}'")
    return record_system(record, read_turns(record[key], key, role_key, content_key))


def detect_messages(record: dict) -> bool:
    return "messages" in record


def messages_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of an OpenAI messages record."""
    return list_turns(record, "messages", "role", "content")


def messages_fields(record: dict) -> tuple[str, ...]:
    return ("messages", "tools", "system")


def detect_sharegpt(record: dict) -> bool:
    return "conversations" in record


def sharegpt_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of a ShareGPT record."""
    return list_turns(record, "conversations", "from", "value")


def sharegpt_fields(record: dict) -> tuple[str, ...]:
    return ("conversations", "tools", "system")
