"""OpenAI's preference fine-tuning records {"input": {"messages", "tools"?}, "preferred_output":
[message], "non_preferred_output": [message]} (OpenAI's SFT and reinforcement records are the
messages list format, data_formats.formats.lists)."""

from __future__ import annotations

from data_formats.conversation import Pair, RecordError
from data_formats.formats.lists import read_turns


def detect(record: dict) -> bool:
    return "preferred_output" in record or "non_preferred_output" in record


def pair(record: dict) -> Pair:
    """The two sides of an OpenAI preference record; the tools are the input's.

    Raises:
        RecordError: missing or malformed fields.
    """
    given = record.get("input")
    if not isinstance(given, dict) or "messages" not in given:
        raise RecordError("OpenAI preference record: field 'input' must be an object with 'messages'")
    prompt = read_turns(given["messages"], "input.messages", "role", "content")
    chosen = read_turns(record.get("preferred_output"), "preferred_output", "role", "content")
    rejected = read_turns(record.get("non_preferred_output"), "non_preferred_output", "role", "content")
    return Pair(prompt + chosen, prompt + rejected, tools_from=given)
