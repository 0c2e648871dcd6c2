"""MedicalGPT's reward records {"question", "response_chosen", "response_rejected", "system"?}: one
question and two answers. (Its other preference layout, {"conversations", "chosen", "rejected"},
is read with TRL's preference type, data_formats.formats.trl.)"""

from __future__ import annotations

from data_formats.conversation import Pair, Turn, string_field


def detect(record: dict) -> bool:
    """Among preference records, any with a `question` is this layout (its answers then must be
    `response_chosen`/`response_rejected`)."""
    return "response_chosen" in record or "question" in record


def pair(record: dict) -> Pair:
    """The two sides of a MedicalGPT record.

    Raises:
        RecordError: missing or malformed fields.
    """
    prompt = [Turn("user", string_field(record, "question"))]
    if isinstance(record.get("system"), str) and record["system"].strip():
        prompt.insert(0, Turn("system", record["system"]))
    chosen = prompt + [Turn("assistant", string_field(record, "response_chosen"))]
    rejected = prompt + [Turn("assistant", string_field(record, "response_rejected"))]
    return Pair(chosen, rejected)
