"""Firefly's records: {"conversation": [{"human", "assistant"}], "system"?}, one user and one
assistant turn per element (the last element's answer may be missing in a prompt)."""

from __future__ import annotations

from data_formats.conversation import RecordError, Turn, json_type, record_system, string_field


def detect(record: dict) -> bool:
    return "conversation" in record


def turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of a Firefly record (optional top-level `system`).

    Raises:
        RecordError: `conversation` is not a non-empty list of {human, assistant} objects.
    """
    rounds = record.get("conversation")
    if not isinstance(rounds, list) or not rounds:
        raise RecordError("field 'conversation' must be a non-empty list of {'human', 'assistant'} objects")
    out = record_system(record)
    for i, item in enumerate(rounds):
        if not isinstance(item, dict):
            raise RecordError(f"conversation[{i}]: must be an object, got {json_type(item)}")
        out.append(Turn("user", string_field(item, "human")))
        if "assistant" in item or i < len(rounds) - 1:
            out.append(Turn("assistant", string_field(item, "assistant")))
    return out


def fields(record: dict) -> tuple[str, ...]:
    return ("conversation", "tools", "system")
