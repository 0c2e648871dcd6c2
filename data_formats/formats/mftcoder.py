"""MFTCoder's records: {"id", "data_name", "chat_rounds": [{"role", "content"}]}, the list format
of its multitask data (`data_name` names the task, data_formats.conversation.task_of)."""

from __future__ import annotations

from data_formats.conversation import Turn
from data_formats.formats.lists import list_turns


def detect(record: dict) -> bool:
    return "chat_rounds" in record


def turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of an MFTCoder record."""
    return list_turns(record, "chat_rounds", "role", "content")


def fields(record: dict) -> tuple[str, ...]:
    return ("chat_rounds", "tools", "system")
