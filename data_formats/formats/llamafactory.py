"""LLaMA-Factory's v1 preference records {"chosen_messages", "rejected_messages"}: each side the
whole conversation as messages, their prompts equal. (Its v0 preference layouts, a prompt as
`conversations` or `messages` and answers as `chosen`/`rejected`, are read with TRL's preference
type, data_formats.formats.trl; its KTO records are the list formats with a label.)"""

from __future__ import annotations

from data_formats.conversation import Pair
from data_formats.formats.lists import read_turns


def detect(record: dict) -> bool:
    return "chosen_messages" in record


def pair(record: dict) -> Pair:
    """The two sides of a v1 record.

    Raises:
        RecordError: missing or malformed message lists.
    """
    chosen = read_turns(record["chosen_messages"], "chosen_messages", "role", "content")
    rejected = read_turns(record.get("rejected_messages"), "rejected_messages", "role", "content")
    return Pair(chosen, rejected, shared=("chosen_messages", "rejected_messages"))
