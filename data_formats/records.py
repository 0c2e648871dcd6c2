"""Each data kind's reader: one record (in the format of its file) -> what the kind's stage reads.

    sft      Conversation ending with the assistant's turn        parse_conversation
    prompts  Conversation ending with the user's turn (or tool    parse_prompt
             results), the record's other fields in `meta`
    rm       (chosen, rejected) Conversations                     parse_preference
    kto      [(Conversation, desirable)]                          parse_unpaired
    pt       the document text                                    parse_text
The layouts themselves are data_formats.formats' entries; the readers here check what every layout
must satisfy (role order, placeholders, a trained answer, two different sides) and add the
configured system prompt.

Refused whatever the format: KTO records (a `label` of true/false on one answer) outside the KTO
kind, which data_formats.unpaired trains.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

from data_formats.conversation import (
    Conversation,
    RecordError,
    Turn,
    check_order,
    check_placeholders,
    check_shared_prompt,
    json_type,
    refuse_unsupported,
    task_of,
)
from data_formats.formats import conversation_layout, pair_detected, pair_layout, unpaired_layout
from data_formats.formats.lists import record_tools
from data_formats.formats.text import document

LABEL_KEYS = ("label", "kto_tag")


def _object(record: Any) -> dict:
    """The record, which must be a JSON object that Relay can train (conversation.refuse_unsupported)."""
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {json_type(record)}")
    refuse_unsupported(record)
    return record


def parse_turns(record: Any, fmt: str, *, require_response: bool = True) -> list[Turn]:
    """The turns of a conversation record in format `fmt` (order not yet checked). Single-turn
    formats (alpaca, pair) need their response field unless `require_response` is False (prompts).

    Raises:
        RecordError: the record does not fit `fmt`.
    """
    record = _object(record)
    layout = conversation_layout(fmt)
    if layout is None:
        raise RecordError(f"format '{fmt}' does not hold a conversation")
    return layout.turns(record, require_response)


def _refuse_label(record: Any) -> None:
    if isinstance(record, dict) and isinstance(record.get("label"), bool):
        raise RecordError(
            "a true/false 'label' on one answer (KTO data): train it with the KTO stage (stages/kto.py), "
            "or its label=true records with SFT"
        )


def parse_conversation(
    record: Any,
    fmt: str,
    *,
    last: str = "assistant",
    task: str = "default",
    source: str = "",
    system_prompt: Optional[str] = None,
) -> Conversation:
    """A checked Conversation from one record. `last` is the role the conversation must end with
    ('assistant' for SFT, 'user' for prompts). `system_prompt` is added when there is no system turn.

    Raises:
        RecordError: the record does not fit `fmt`, its role order is wrong, or it is KTO data
            (data_formats.unpaired reads that).
    """
    _refuse_label(record)
    turns = parse_turns(record, fmt)
    check_order(turns, last)
    check_placeholders(turns)
    if system_prompt is not None and turns[0].role != "system":
        turns = [Turn("system", system_prompt)] + turns
    return Conversation(turns, task=task_of(record, task), source=source, tools=record_tools(record))


def parse_prompt(
    record: Any, fmt: str, *, task: str = "default", source: str = "", system_prompt: Optional[str] = None
) -> Conversation:
    """A PPO/GRPO prompt: a conversation ending with the user's turn (or tool results), or the
    question of a single-turn record. The record's other fields (a `question`/`answer` record's
    answer, ...) go into `meta`: GRPO passes them to reward functions as keyword arguments, as TRL
    passes a dataset's extra columns; a single-turn record's `tools` are its schemas, as a
    conversation's are.

    Raises:
        RecordError: the record does not fit `fmt`, or its role order is wrong (among them a prompt
            that ends with an assistant turn: the PPO/GRPO stages answer with a new assistant turn,
            they do not continue one).
    """
    layout = conversation_layout(fmt)
    if layout is not None and not layout.single_turn:
        conv = parse_conversation(record, fmt, last="user", task=task, source=source, system_prompt=system_prompt)
        conv.meta = {k: v for k, v in record.items() if k not in layout.fields(record)}
        return conv
    parse_turns(record, fmt, require_response=False)  # says what the record lacks or holds wrong
    used = layout.fields(record)
    # The prompt is read from the prompt's own fields alone (its answer, if any, is meta), so a
    # prompt that itself ends with an assistant turn is refused as the same turns in `messages` are.
    turns = parse_turns({k: v for k, v in record.items() if k in used}, fmt, require_response=False)
    check_order(turns, "user")
    conv = Conversation(
        turns,
        task=task_of(record, task),
        source=source,
        meta={k: v for k, v in record.items() if k not in used},
        tools=record_tools(record),
        standard=isinstance(record.get(used[0]), str),
    )
    if system_prompt is not None and conv.turns[0].role != "system":  # the record's own system turn wins
        conv.turns.insert(0, Turn("system", system_prompt))
    return conv


def parse_preference(
    record: Any, *, task: str = "default", source: str = "", system_prompt: Optional[str] = None
) -> tuple[Conversation, Conversation]:
    """(chosen, rejected) conversations from a preference record (its layout: formats.pair_layout).
    The answers may be tool calls, and the prompt may end with tool results.

    Raises:
        RecordError: missing or malformed fields, wrong role order, or identical sides.
    """
    record = _object(record)
    tools = record_tools(record)
    pair = pair_layout(record).pair(record)
    if pair.tools_from is not None:
        tools = record_tools(pair.tools_from)
    chosen, rejected = pair.chosen, pair.rejected
    for turns in (chosen, rejected):
        check_order(turns, "assistant")
        check_placeholders(turns)
        if not turns[-1].trained:
            raise RecordError("the compared answer has 'weight' 0; a preference pair compares trained answers")
    if pair.shared:
        check_shared_prompt(chosen, rejected, *pair.shared)
    if chosen == rejected:
        raise RecordError("chosen and rejected are identical")
    if system_prompt is not None and chosen[0].role != "system":
        chosen = [Turn("system", system_prompt)] + chosen
        rejected = [Turn("system", system_prompt)] + rejected
    name = task_of(record, task)
    return Conversation(chosen, name, source, tools=tools), Conversation(rejected, name, source, tools=tools)


def record_label(record: dict) -> Optional[bool]:
    """A KTO record's desirability label, None when it has none (a paired record).

    Raises:
        RecordError: the label is not a JSON true/false, or both keys are given.
    """
    keys = [k for k in LABEL_KEYS if k in record]
    if len(keys) > 1:
        raise RecordError("both 'label' and 'kto_tag' given; keep one")
    if not keys:
        return None
    value = record[keys[0]]
    if not isinstance(value, bool):
        raise RecordError(f"field '{keys[0]}' must be true or false, got {value!r}")
    return value


def parse_unpaired(
    record: Any, *, task: str = "default", source: str = "", system_prompt: Optional[str] = None
) -> list[tuple[Conversation, bool]]:
    """[(conversation ending in the judged answer, desirable)]: one for a labelled record, two
    (chosen True, rejected False) for a paired one (data_formats.unpaired).

    Raises:
        RecordError: missing or malformed fields, a bad label, or a wrong role order.
    """
    record = _object(record)
    label = record_label(record)
    if label is None and unpaired_layout(record) is not None and not pair_detected(record):
        raise RecordError("an answer without its 'label' (true: desirable, false: undesirable; or 'kto_tag')")
    if label is None:
        chosen, rejected = parse_preference(record, task=task, source=source, system_prompt=system_prompt)
        return [(chosen, True), (rejected, False)]
    layout = unpaired_layout(record)
    if layout is None:
        raise RecordError(
            "a labelled record needs 'prompt' and 'completion' (TRL) or 'messages'/'conversations' (LLaMA-Factory)"
        )
    turns = layout.turns(record, True)
    check_order(turns, "assistant")
    check_placeholders(turns)
    if system_prompt is not None and turns[0].role != "system":
        turns = [Turn("system", system_prompt)] + turns
    return [(Conversation(turns, task_of(record, task), source, tools=record_tools(record)), label)]


def parse_text(record: Any, text_field: str = "text") -> str:
    """The document in a PT record.

    Raises:
        RecordError: the field is missing, not a string, or empty.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {json_type(record)}")
    return document(record, text_field)


def margin_of(record: dict, margin_field: Optional[str]) -> float:
    """A preference record's margin (`data.margin_field`), 0 when none is configured.

    Raises:
        RecordError: the field is missing, not a number, or not finite (Python's JSON reader takes
            NaN and Infinity, which would make the loss nan).
    """
    if margin_field is None:
        return 0.0
    if margin_field not in record:
        raise RecordError(f"missing field '{margin_field}' (data.margin_field)")
    value = record[margin_field]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RecordError(f"field '{margin_field}' must be a number, got {json_type(value)}")
    if not math.isfinite(value):
        raise RecordError(f"field '{margin_field}' must be a finite number, got {value!r}")
    return float(value)
