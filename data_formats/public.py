"""Readers for the public record formats beside the list formats of data_formats.conversation.

  hh          Anthropic HH-RLHF transcripts {"chosen", "rejected"}: each side one text of
              "\\n\\nHuman: ..." and "\\n\\nAssistant: ..." turns. The shared prompt is split off as
              TRL's `extract_prompt` does (the common beginning of both sides), but at turn
              boundaries: every turn but the last is the prompt and must be the same on both sides.
              The same after `extract_prompt` ({"prompt", "chosen", "rejected"} texts) reads alike.
  openai_dpo  OpenAI's preference fine-tuning format {"input": {"messages", "tools"?},
              "preferred_output": [message], "non_preferred_output": [message]}.
  firefly     Firefly {"conversation": [{"human", "assistant"}], "system"?}: one user and one
              assistant turn per element.
  prompt_completion  TRL's prompt-completion type {"prompt", "completion"}: strings (standard) or
              message lists (conversational); a prompt-only record is TRL's prompt-only type.
Refused in one line naming the format and the fix: TRL's stepwise supervision (per-step labels,
process reward data), and implicit-prompt preference texts that are not transcripts (TRL would cut
the prompt at the first differing character, which is rarely where the prompt ends).

A turn's text is kept as written (no stripping): only the one space after "Human:"/"Assistant:",
which belongs to the transcript's layout, is not part of the turn.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from data_formats.conversation import RecordError, Turn, _record_system, _string, _turns, record_tools

HH_ROLES = {"Human": "user", "Assistant": "assistant"}
_HH_SPLIT = re.compile(r"\n\n(Human|Assistant):")


def is_hh(record: dict) -> bool:
    """Whether a record holds HH-RLHF transcripts (its `chosen` text starts with a Human turn)."""
    chosen = record.get("chosen")
    return isinstance(chosen, str) and chosen.lstrip("\n").startswith("Human:")


def hh_turns(text: Any, key: str) -> list[Turn]:
    """The turns of one HH-RLHF transcript.

    Raises:
        RecordError: not a string, or not made of Human/Assistant turns.
    """
    if not isinstance(text, str):
        raise RecordError(f"field '{key}' must be a Human:/Assistant: transcript string, got {type(text).__name__}")
    body = text if text.startswith("\n\n") else "\n\n" + text.lstrip("\n")
    pieces = _HH_SPLIT.split(body)
    if pieces[0].strip() or len(pieces) < 3:
        raise RecordError(f"field '{key}': not an HH-RLHF transcript (it must start with '\\n\\nHuman:')")
    turns = []
    for speaker, content in zip(pieces[1::2], pieces[2::2]):
        content = content[1:] if content.startswith(" ") else content
        if not content.strip():
            raise RecordError(f"field '{key}': empty {speaker} turn {len(turns)} in the transcript")
        turns.append(Turn(HH_ROLES[speaker], content))
    return turns


def hh_pair(record: dict) -> tuple[list[Turn], list[Turn]]:
    """(chosen, rejected) turns of an HH-RLHF record; both share every turn but their last.

    Raises:
        RecordError: a side is not a transcript, or the sides differ before their last turn.
    """
    chosen, rejected = hh_turns(record.get("chosen"), "chosen"), hh_turns(record.get("rejected"), "rejected")
    shared = min(len(chosen), len(rejected)) - 1
    for i in range(shared):
        if chosen[i] != rejected[i]:
            raise RecordError(f"HH-RLHF transcript: chosen and rejected differ at turn {i}, before their last turn; a "
                              f"preference pair needs one shared prompt (drop the record, or cut both sides at turn {i})")
    if len(chosen) != len(rejected):
        raise RecordError(f"HH-RLHF transcript: chosen has {len(chosen)} turns, rejected {len(rejected)}; both must be "
                          "the same prompt followed by one answer")
    return chosen, rejected


def is_hh_prompt(record: dict) -> bool:
    """Whether a record is HH-RLHF after TRL's `extract_prompt` (Dahoas/full-hh-rlhf's layout too):
    a `prompt` transcript and the rest of each side as texts."""
    prompt = record.get("prompt")
    return (isinstance(prompt, str) and prompt.lstrip("\n").startswith("Human:")
            and isinstance(record.get("chosen"), str) and isinstance(record.get("rejected"), str))


def hh_prompt_pair(record: dict) -> tuple[list[Turn], list[Turn]]:
    """(chosen, rejected) turns of an `is_hh_prompt` record: read as the whole transcripts (prompt +
    side), since TRL cuts the prompt at the first differing character, which may fall inside the
    answers (both starting "I'm ...").

    Raises:
        RecordError: see `hh_pair`.
    """
    return hh_pair({key: record["prompt"] + record[key] for key in ("chosen", "rejected")})


def is_openai_preference(record: dict) -> bool:
    return "preferred_output" in record or "non_preferred_output" in record


def openai_preference(record: dict) -> tuple[list[Turn], list[Turn], Optional[list[dict]]]:
    """(chosen, rejected, tools) of an OpenAI preference fine-tuning record.

    Raises:
        RecordError: missing or malformed fields.
    """
    given = record.get("input")
    if not isinstance(given, dict) or "messages" not in given:
        raise RecordError("OpenAI preference record: field 'input' must be an object with 'messages'")
    prompt = _turns(given["messages"], "input.messages", "role", "content")
    chosen = _turns(record.get("preferred_output"), "preferred_output", "role", "content")
    rejected = _turns(record.get("non_preferred_output"), "non_preferred_output", "role", "content")
    return prompt + chosen, prompt + rejected, record_tools(given)


def firefly_turns(record: dict) -> list[Turn]:
    """The turns of a Firefly record (optional top-level `system`).

    Raises:
        RecordError: `conversation` is not a non-empty list of {human, assistant} objects.
    """
    rounds = record.get("conversation")
    if not isinstance(rounds, list) or not rounds:
        raise RecordError("field 'conversation' must be a non-empty list of {'human', 'assistant'} objects")
    turns = _record_system(record)
    for i, item in enumerate(rounds):
        if not isinstance(item, dict):
            raise RecordError(f"conversation[{i}]: must be an object, got {type(item).__name__}")
        turns.append(Turn("user", _string(item, "human")))
        if "assistant" in item or i < len(rounds) - 1:
            turns.append(Turn("assistant", _string(item, "assistant")))
    return turns


def _messages_or_text(record: dict, key: str, role: str) -> list[Turn]:
    value = record.get(key)
    if isinstance(value, list):
        return _turns(value, key, "role", "content")
    return [Turn(role, _string(record, key))]


def prompt_completion_turns(record: dict, require_response: bool = True) -> list[Turn]:
    """The turns of a TRL prompt-completion (or prompt-only) record, standard or conversational.

    Raises:
        RecordError: missing or malformed fields.
    """
    turns = _messages_or_text(record, "prompt", "user")
    if require_response or "completion" in record:
        turns += _messages_or_text(record, "completion", "assistant")
    return turns


def refuse_unusable(keys: set) -> None:
    """Refuse TRL dataset types Relay has no stage for (see the module docstring).

    Raises:
        RecordError: stepwise supervision records.
    """
    if {"completions", "labels"} <= keys:
        raise RecordError("TRL stepwise supervision record ('completions' with per-step 'labels', process reward data): "
                          "Relay has no process reward model stage; join the steps into one answer for SFT, or pair a "
                          "good and a bad answer to the prompt for RM/DPO")


def whole_conversations(record: dict) -> bool:
    """Whether `chosen` is a whole conversation (a message list that starts before the answer). Its
    `prompt`/`messages`/`conversations`, if any, must then be a copy of part of it (UltraFeedback's
    layout: TRL reads the prompt from the conversations, `maybe_extract_prompt`, and so does Relay).

    Raises:
        RecordError: such a field that is not a copy of part of `chosen`.
    """
    chosen = record.get("chosen")
    first = chosen[0] if isinstance(chosen, list) and chosen else None
    if not isinstance(first, dict) or str(first.get("role", first.get("from"))).lower() not in ("user", "human", "system"):
        return False
    for key in ("prompt", "messages", "conversations"):
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, list):
            copied = value == chosen[:len(value)]
        else:
            copied = any(isinstance(m, dict) and m.get("content", m.get("value")) == value for m in chosen)
        if not copied:
            raise RecordError(f"'chosen' holds the whole conversation, and field '{key}' is not a copy of part of it: "
                              f"drop '{key}', or keep only the answers in 'chosen'/'rejected'")
    return True


def implicit_prompt_text() -> RecordError:
    """The refusal of a {chosen, rejected} pair of plain texts (no prompt, not transcripts)."""
    return RecordError("'chosen' and 'rejected' are plain texts without a 'prompt' (TRL's implicit-prompt standard "
                       "type) and not Human:/Assistant: transcripts: add the prompt as 'prompt' and keep only the "
                       "answers in 'chosen'/'rejected', or give each side as a message list")
