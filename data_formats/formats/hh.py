"""Anthropic's HH-RLHF transcripts {"chosen", "rejected"}: each side one text of "\\n\\nHuman: ..."
and "\\n\\nAssistant: ..." turns. The shared prompt is split off as TRL's `extract_prompt` does (the
common beginning of both sides), but at turn boundaries: every turn but the last is the prompt and
must be the same on both sides. The same after `extract_prompt` ({"prompt", "chosen", "rejected"}
texts, Dahoas/full-hh-rlhf's layout too) reads alike.

A turn's text is kept as written (no stripping): only the one space after "Human:"/"Assistant:",
which belongs to the transcript's layout, is not part of the turn.
"""

from __future__ import annotations

import re
from typing import Any

from data_formats.conversation import Pair, RecordError, Turn, json_type

HH_ROLES = {"Human": "user", "Assistant": "assistant"}
_HH_SPLIT = re.compile(r"\n\n(Human|Assistant):")


def is_transcript(text: Any) -> bool:
    """Whether a text is an HH-RLHF transcript (it starts with a Human turn)."""
    return isinstance(text, str) and text.lstrip("\n").startswith("Human:")


def detect(record: dict) -> bool:
    """Two whole transcripts: `chosen` is one, and there is no separate prompt."""
    return is_transcript(record.get("chosen")) and "prompt" not in record


def transcript_turns(text: Any, key: str) -> list[Turn]:
    """The turns of one HH-RLHF transcript.

    Raises:
        RecordError: not a string, or not made of Human/Assistant turns.
    """
    if not isinstance(text, str):
        raise RecordError(f"field '{key}' must be a Human:/Assistant: transcript string, got {json_type(text)}")
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


def pair(record: dict) -> Pair:
    """The two sides of an HH-RLHF record; both share every turn but their last.

    Raises:
        RecordError: a side is not a transcript, or the sides differ before their last turn.
    """
    chosen = transcript_turns(record.get("chosen"), "chosen")
    rejected = transcript_turns(record.get("rejected"), "rejected")
    shared = min(len(chosen), len(rejected)) - 1
    for i in range(shared):
        if chosen[i] != rejected[i]:
            raise RecordError(
                f"HH-RLHF transcript: chosen and rejected differ at turn {i}, before their last turn; a "
                f"preference pair needs one shared prompt (drop the record, or cut both sides at turn {i})"
            )
    if len(chosen) != len(rejected):
        raise RecordError(
            f"HH-RLHF transcript: chosen has {len(chosen)} turns, rejected {len(rejected)}; both must be "
            "the same prompt followed by one answer"
        )
    return Pair(chosen, rejected)


def detect_prompt(record: dict) -> bool:
    """HH-RLHF after TRL's `extract_prompt`: a `prompt` transcript and the rest of each side as texts."""
    return (
        is_transcript(record.get("prompt"))
        and isinstance(record.get("chosen"), str)
        and isinstance(record.get("rejected"), str)
    )


def prompt_pair(record: dict) -> Pair:
    """The two sides of a `detect_prompt` record, read as the whole transcripts (prompt + side),
    since TRL cuts the prompt at the first differing character, which may fall inside the answers
    (both starting "I'm ...").

    Raises:
        RecordError: see `pair`.
    """
    return pair({key: record["prompt"] + record[key] for key in ("chosen", "rejected")})
