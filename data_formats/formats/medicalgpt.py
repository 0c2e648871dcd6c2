"""MedicalGPT's reward records {"question", "response_chosen", "response_rejected", "system"?,
"history"?}: one question and two answers, after the system prompt and the earlier
[question, answer] rounds of `history`, as its reward-modeling and DPO scripts build the prompt
(`system or ""`, then history + [[question, answer]]). (Its other preference layout,
{"conversations", "chosen", "rejected"}, is read with TRL's preference type,
data_formats.formats.trl.)"""

from __future__ import annotations

from data_formats.conversation import Pair, Turn, history_turns, record_system, string_field


def detect(record: dict) -> bool:
    """Among preference records, any with a `question` is this layout (its answers then must be
    `response_chosen`/`response_rejected`)."""
    return "response_chosen" in record or "question" in record


def pair(record: dict) -> Pair:
    """The two sides of a MedicalGPT record: its system prompt (null or blank: none), its history's
    rounds, the question, then each answer.

    Raises:
        RecordError: missing or malformed fields (a `system` that is not a string, a `history` that
            is not a list of [question, answer] string pairs).
    """
    prompt = record_system(record, history_turns(record) + [Turn("user", string_field(record, "question"))])
    chosen = prompt + [Turn("assistant", string_field(record, "response_chosen"))]
    rejected = prompt + [Turn("assistant", string_field(record, "response_rejected"))]
    return Pair(chosen, rejected)
