"""TRL's dataset types (docs "Dataset formats and types"), standard (texts) or conversational
(message lists):

  prompt_completion  {"prompt", "completion"}; a prompt-only record is TRL's prompt-only type
              (the `prompt` format, data_formats.formats.single_turn).
  preference  {"prompt", "chosen", "rejected"} (strings or message lists), the same with the prompt
              as `conversations` or `messages` and each answer a string, one turn or a list
              (MedicalGPT, LLaMA-Factory v0; `tools` allowed), and the implicit-prompt type: each
              side the whole conversation ({"chosen", "rejected"} message lists; a `prompt` copied
              from them is allowed, UltraFeedback's layout, as TRL's `maybe_extract_prompt` reads it).
  unpaired    {"prompt", "completion", "label": bool} (KTOTrainer's; the KTO stage's kind).
Refused in one line naming the type and the fix: stepwise supervision (per-step labels, process
reward data), and implicit-prompt preference texts that are not HH-RLHF transcripts (TRL would cut
the prompt at the first differing character, which is rarely where the prompt ends).
"""

from __future__ import annotations

from data_formats.conversation import Pair, RecordError, Turn, record_system, string_field
from data_formats.formats.lists import read_turn, read_turns

PREFERENCE_KEYS = ("chosen", "response_chosen", "chosen_messages", "preferred_output")
"""Any of these makes a record preference data (auto-detection; each layout then says which)."""


STEPWISE = (
    "TRL stepwise supervision record ('completions' with per-step 'labels', process reward data): Relay has "
    "no process reward model stage; join the steps into one answer for SFT, or pair a good and a bad answer "
    "to the prompt for RM/DPO"
)


def detect_stepwise(record: dict) -> bool:
    """TRL's stepwise supervision type, which Relay has no stage for (refused: `STEPWISE`)."""
    return {"completions", "labels"} <= set(record)


def detect_prompt_completion(record: dict) -> bool:
    return "completion" in record and "prompt" in record and "label" not in record


def _messages_or_text(record: dict, key: str, role: str) -> list[Turn]:
    value = record.get(key)
    if isinstance(value, list):
        return read_turns(value, key, "role", "content")
    return [Turn(role, string_field(record, key))]


def prompt_completion_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of a TRL prompt-completion (or prompt-only) record, standard or conversational.

    Raises:
        RecordError: missing or malformed fields.
    """
    turns = _messages_or_text(record, "prompt", "user")
    if require_response or "completion" in record:
        turns += _messages_or_text(record, "completion", "assistant")
    return turns


def prompt_fields(record: dict) -> tuple[str, ...]:
    return ("prompt",)


def detect_unpaired(record: dict) -> bool:
    """Among labelled (KTO) records, TRL's: a `completion` beside the label."""
    return "completion" in record


def unpaired_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of a labelled TRL record (the label itself is the KTO reader's, data_formats.records).

    Raises:
        RecordError: missing or malformed fields.
    """
    prompt, completion = record.get("prompt"), record["completion"]
    if isinstance(completion, list):
        if isinstance(prompt, list):
            turns = read_turns(prompt, "prompt", "role", "content")
        else:
            turns = [Turn("user", string_field(record, "prompt"))]
        return turns + read_turns(completion, "completion", "role", "content")
    return [Turn("user", string_field(record, "prompt")), Turn("assistant", string_field(record, "completion"))]


def detect_preference(record: dict) -> bool:
    return any(key in record for key in PREFERENCE_KEYS)


def preference_pair(record: dict) -> Pair:
    """The two sides of a TRL preference record (the module docstring): the shared prompt, then
    each answer; or each side whole, when `chosen` holds the whole conversation.

    Raises:
        RecordError: missing or malformed fields, or an implicit-prompt pair of plain texts.
    """
    prompt = _prompt(record)
    chosen, rejected = _side(record, "chosen", prompt), _side(record, "rejected", prompt)
    return Pair(chosen, rejected, shared=None if prompt else ("chosen", "rejected"))


def _prompt(record: dict) -> list[Turn]:
    """The shared prompt of a {prompt|conversations|messages, chosen, rejected} record ([] when the
    answers hold whole conversations)."""
    if _whole_conversations(record):
        return []
    if isinstance(record.get("conversations"), list):
        return record_system(record, read_turns(record["conversations"], "conversations", "from", "value"))
    if isinstance(record.get("messages"), list):
        return record_system(record, read_turns(record["messages"], "messages", "role", "content"))
    prompt_value = record.get("prompt")
    if isinstance(prompt_value, list):
        return read_turns(prompt_value, "prompt", "role", "content")
    if prompt_value is None and isinstance(record.get("chosen"), str):
        raise _implicit_prompt_text()
    return [Turn("user", string_field(record, "prompt"))]


def _side(record: dict, key: str, prompt: list[Turn]) -> list[Turn]:
    """One answer of a preference record after its prompt: a string, one turn, or a list of turns
    (which may hold the whole conversation when there is no separate prompt)."""
    value = record.get(key)
    if isinstance(value, list):
        sharegpt = bool(value) and isinstance(value[0], dict) and "from" in value[0]
        turns = read_turns(value, key, *(("from", "value") if sharegpt else ("role", "content")))
        return prompt + turns if prompt else turns
    if isinstance(value, dict):
        return prompt + [read_turn(value, key, *(("from", "value") if "from" in value else ("role", "content")))]
    return prompt + [Turn("assistant", string_field(record, key))]


def _whole_conversations(record: dict) -> bool:
    """Whether `chosen` is a whole conversation (a message list that starts before the answer). Its
    `prompt`/`messages`/`conversations`, if any, must then be a copy of part of it (UltraFeedback's
    layout: TRL reads the prompt from the conversations, `maybe_extract_prompt`, and so does Relay).

    Raises:
        RecordError: such a field that is not a copy of part of `chosen`.
    """
    chosen = record.get("chosen")
    first = chosen[0] if isinstance(chosen, list) and chosen else None
    if not isinstance(first, dict) or str(first.get("role", first.get("from"))).lower() not in (
        "user",
        "human",
        "system",
    ):
        return False
    for key in ("prompt", "messages", "conversations"):
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            copied = value == chosen[: len(value)]
        else:
            copied = any(isinstance(m, dict) and m.get("content", m.get("value")) == value for m in chosen)
        if not copied:
            raise RecordError(
                f"'chosen' holds the whole conversation, and field '{key}' is not a copy of part of it: "
                f"drop '{key}', or keep only the answers in 'chosen'/'rejected'"
            )
    return True


def _implicit_prompt_text() -> RecordError:
    """The refusal of a {chosen, rejected} pair of plain texts (no prompt, not transcripts)."""
    return RecordError(
        "'chosen' and 'rejected' are plain texts without a 'prompt' (TRL's implicit-prompt standard "
        "type) and not Human:/Assistant: transcripts: add the prompt as 'prompt' and keep only the "
        "answers in 'chosen'/'rejected', or give each side as a message list"
    )
