"""Single-turn records: one question and (except in a prompt) its answer.

  alpaca      {"instruction", "input"?, "output", "system"?, "history"?}; the user turn is the
              instruction, then a blank line and the input when the input is not empty (the
              Stanford Alpaca layout), after the system turn and the earlier [instruction, response]
              pairs of `history` (LLaMA-Factory's alpaca columns, as its dataset_info.json reads them)
  pair        {"prompt","response"} | {"question","answer"} | {"input","output"}
  prompt      {"prompt"} | {"question"} | {"input"}: a prompt without its answer (PPO/GRPO prompts;
              TRL's prompt-only type, whose prompt may also be a message list)
As a prompt, such a record is its question alone: every other field (its answer among them) goes
into Conversation.meta, the reward functions' keyword arguments.
"""

from __future__ import annotations

from data_formats.conversation import RecordError, Turn, history_turns, json_type, record_system, string_field
from data_formats.formats.trl import prompt_completion_turns

PAIR_KEYS = (("prompt", "response"), ("question", "answer"), ("input", "output"))


def detect_alpaca(record: dict) -> bool:
    return "instruction" in record


def alpaca_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of an Alpaca record; its `output` may be missing when not `require_response`.

    Raises:
        RecordError: missing or malformed fields.
    """
    instruction = string_field(record, "instruction")
    extra = record.get("input", "")
    if not isinstance(extra, str):
        raise RecordError(f"field 'input' must be a string, got {json_type(extra)}")
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    turns = record_system(record) + history_turns(record) + [Turn("user", user)]
    if require_response or "output" in record:
        turns.append(Turn("assistant", string_field(record, "output")))
    return turns


def alpaca_fields(record: dict) -> tuple[str, ...]:
    return ("instruction", "input", "system", "history")


def detect_pair(record: dict) -> bool:
    return any(a in record and b in record for a, b in PAIR_KEYS)


def _question_answer(record: dict, require_response: bool) -> list[Turn]:
    for a, b in PAIR_KEYS:
        if a in record:
            turns = [Turn("user", string_field(record, a))]
            if require_response or b in record:
                turns.append(Turn("assistant", string_field(record, b)))
            return turns
    raise RecordError("missing field 'prompt' (or 'question'/'input')")


def pair_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of a pair record (the first of PAIR_KEYS' questions it holds, and its answer).

    Raises:
        RecordError: missing or malformed fields.
    """
    return _question_answer(record, require_response)


def question_fields(record: dict) -> tuple[str, ...]:
    """The field that holds a pair's or a prompt's question."""
    return (next(a for a, _ in PAIR_KEYS if a in record),)


def detect_prompt(record: dict) -> bool:
    return "prompt" in record or "question" in record


def prompt_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of a prompt record: its question, and its answer only when the record holds one.

    Raises:
        RecordError: missing or malformed fields.
    """
    if isinstance(record.get("prompt"), list):
        return prompt_completion_turns(record, False)
    return _question_answer(record, False)
