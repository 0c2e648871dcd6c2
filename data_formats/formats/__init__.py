"""The record formats: one module per family, each entry of `REGISTRY` one record layout.

    family         module           formats (the config's `format`)
    list formats   lists.py         messages (OpenAI), sharegpt
    MFTCoder       mftcoder.py      chatml
    single-turn    single_turn.py   alpaca, pair, prompt
    Firefly        firefly.py       firefly
    TRL types      trl.py           prompt_completion, preference (prompt/chosen/rejected), KTO's
                                    unpaired; stepwise supervision refused
    HH-RLHF        hh.py            preference (transcripts, and after TRL's extract_prompt)
    OpenAI         openai.py        preference (preference fine-tuning)
    MedicalGPT     medicalgpt.py    preference (question, response_chosen/response_rejected)
    LLaMA-Factory  llamafactory.py  preference (v1 chosen_messages/rejected_messages)
    documents      text.py          text (PT)
Tool calls and schemas inside messages: data_formats.tools. The common types the entries read
records into (`Turn`, `Conversation`, `Pair`) and the checks they share: data_formats.conversation.
Each data kind's reader (SFT conversations, prompts, preference pairs, KTO records, documents)
goes through this registry: data_formats.records.

An entry is one layout: the `format` name it answers to, the data kinds it serves, `detect`
(whether a record has this layout, from its keys) and the reader: `turns` for a conversation,
`pair` for a preference record. A file's format is detected from its first record: the first entry,
in REGISTRY's order, that detects it (`detect_format`; entries with `auto` False are told apart
only among the layouts of their kind). A preference record, whatever its file's format, is read by
the first preference entry that detects it, else by TRL's (`pair_layout`); a KTO record with a
label by the first KTO entry that detects it (`unpaired_layout`).

Add a format: its family module (`detect`, `turns` or `pair`), one entry here at the place of its
priority (a new `format` name also goes into NAMES), one test in tests/test_format_registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from data_formats.conversation import Pair, RecordError, Turn, json_type, refuse_unsupported
from data_formats.formats import firefly, hh, lists, llamafactory, medicalgpt, mftcoder, openai, single_turn, text, trl

KINDS = ("sft", "pt", "rm", "prompts", "kto")
KIND_NAMES = {
    "sft": "SFT conversations",
    "pt": "PT text",
    "rm": "RM preference pairs",
    "prompts": "PPO prompts",
    "kto": "KTO records (data_formats.unpaired)",
}
# Where data of a kind belongs: said when it reaches a stage that cannot use it.
KIND_ADVICE = {
    "sft": "use the SFT stage (stages/sft.py)",
    "pt": "use the PT stage (stages/pretrain.py)",
    "rm": "use the RM stage (stages/reward.py)",
    "prompts": "use them as PPO prompts (stages/ppo.py)",
    "kto": "use the KTO stage (stages/kto.py)",
}
NAMES = (
    "chatml",
    "messages",
    "sharegpt",
    "alpaca",
    "pair",
    "firefly",
    "prompt_completion",
    "preference",
    "prompt",
    "text",
)
"""The values of the data section's `format` (besides 'auto'), in the order help and messages list them."""
UNPAIRED = "unpaired"
"""The format of a KTO file (its layouts are told apart per record, by their label)."""


def _no_fields(record: dict) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Format:
    """One record layout (see the module docstring)."""

    name: str
    """The `format` it answers to; the layouts of preference records share 'preference'."""
    kinds: tuple[str, ...]
    """The data kinds it serves, the one its records train first (the advice for data of another kind)."""
    detect: Callable[[dict], bool]
    """Whether a record (a JSON object) has this layout, from its keys."""
    turns: Optional[Callable[[dict, bool], list[Turn]]] = None
    """turns(record, require_response): the conversation, order not yet checked (the kind's reader
    checks it); a single-turn layout leaves a missing answer out when `require_response` is False."""
    pair: Optional[Callable[[dict], Pair]] = None
    """pair(record): the two sides of a preference record."""
    fields: Callable[[dict], tuple[str, ...]] = _no_fields
    """The fields a prompt is read from: a prompt record's other fields go into Conversation.meta."""
    single_turn: bool = False
    """One question and its answer: a prompt is the question alone (its answer, if any, in meta)."""
    what: str = ""
    """What data of this layout is, in the wrong-kind message (default "'<name>' conversations")."""
    auto: bool = True
    """Whether auto-detection may answer with it (False: a layout told apart only within its kind)."""
    refusal: str = ""
    """Set on a layout Relay has no stage for: detecting it refuses the record with this reason."""

    @property
    def description(self) -> str:
        return self.what or f"'{self.name}' conversations"


PREFERENCE = "preference data (chosen/rejected)"
REGISTRY: tuple[Format, ...] = (
    Format("stepwise", (), trl.detect_stepwise, refusal=trl.STEPWISE),
    Format("chatml", ("sft", "prompts"), mftcoder.detect, mftcoder.turns, fields=mftcoder.fields),
    Format("preference", ("rm", "kto"), openai.detect, pair=openai.pair, what=PREFERENCE, auto=False),
    Format("preference", ("rm", "kto"), hh.detect, pair=hh.pair, what=PREFERENCE, auto=False),
    Format("preference", ("rm", "kto"), hh.detect_prompt, pair=hh.prompt_pair, what=PREFERENCE, auto=False),
    Format("preference", ("rm", "kto"), medicalgpt.detect, pair=medicalgpt.pair, what=PREFERENCE, auto=False),
    Format("preference", ("rm", "kto"), llamafactory.detect, pair=llamafactory.pair, what=PREFERENCE, auto=False),
    Format("preference", ("rm", "kto"), trl.detect_preference, pair=trl.preference_pair, what=PREFERENCE),
    Format("firefly", ("sft", "prompts"), firefly.detect, firefly.turns, fields=firefly.fields),
    Format(
        "prompt_completion",
        ("sft", "prompts"),
        trl.detect_prompt_completion,
        trl.prompt_completion_turns,
        fields=trl.prompt_fields,
        single_turn=True,
    ),
    Format(UNPAIRED, ("kto",), trl.detect_unpaired, trl.unpaired_turns, auto=False),
    Format(
        "messages", ("sft", "prompts", "kto"), lists.detect_messages, lists.messages_turns, fields=lists.messages_fields
    ),
    Format(
        "sharegpt", ("sft", "prompts", "kto"), lists.detect_sharegpt, lists.sharegpt_turns, fields=lists.sharegpt_fields
    ),
    Format(
        "alpaca",
        ("sft", "prompts"),
        single_turn.detect_alpaca,
        single_turn.alpaca_turns,
        fields=single_turn.alpaca_fields,
        single_turn=True,
    ),
    Format("text", ("pt",), text.detect, what="raw text (text)"),
    Format(
        "pair",
        ("sft", "prompts"),
        single_turn.detect_pair,
        single_turn.pair_turns,
        fields=single_turn.question_fields,
        single_turn=True,
    ),
    Format(
        "prompt",
        ("prompts",),
        single_turn.detect_prompt,
        single_turn.prompt_turns,
        fields=single_turn.question_fields,
        single_turn=True,
        what="prompts without responses",
    ),
)


def detect_format(record: Any) -> str:
    """The format a record looks like, from its keys (the first auto entry that detects it).

    Raises:
        RecordError: the record is not a JSON object, is refused (data_formats.conversation,
            an entry's `refusal`), or matches no known format.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {json_type(record)}")
    refuse_unsupported(record)
    for entry in REGISTRY:
        if entry.auto and entry.detect(record):
            if entry.refusal:
                raise RecordError(entry.refusal)
            return entry.name
    raise RecordError(f"unrecognised record format (keys: {', '.join(sorted(map(str, record))) or 'none'})")


def conversation_layout(fmt: str) -> Optional[Format]:
    """The entry that reads conversations of format `fmt`, or None (a format of pairs or documents)."""
    return next((e for e in REGISTRY if e.name == fmt and e.turns is not None), None)


def kind_formats(kind: str) -> tuple[str, ...]:
    """The formats auto-detection may find in data of `kind`, in NAMES' order."""
    served = {e.name for e in REGISTRY if e.auto and kind in e.kinds}
    return tuple(name for name in NAMES if name in served)


def given_formats(kind: str) -> tuple[str, ...]:
    """The formats that read data of `kind` when named (data.format, --format), in NAMES' order."""
    readers = {e.name for e in REGISTRY if kind in e.kinds}
    return tuple(name for name in NAMES if name in readers)


def format_problem(fmt: str, kind: str) -> Optional[str]:
    """Why format `fmt` cannot read data of `kind` (None: it can, or 'auto')."""
    if fmt == "auto" or fmt in given_formats(kind):
        return None
    where = "is not a format" if fmt not in NAMES else f"does not read {KIND_NAMES[kind]}"
    return f"format {fmt!r} (data.format, --format) {where}: use auto or one of {', '.join(given_formats(kind))}"


def hint(fmt: str) -> tuple[str, str]:
    """(what data of format `fmt` is, where it belongs) for the wrong-kind message."""
    entry = next(e for e in REGISTRY if e.name == fmt and e.auto)
    return entry.description, KIND_ADVICE[entry.kinds[0]]


def pair_layout(record: dict) -> Format:
    """The preference layout of a record: the first preference entry that detects it, else TRL's
    (the last, whose reader says what the record lacks)."""
    layouts = [e for e in REGISTRY if e.pair is not None]
    return next((e for e in layouts if e.detect(record)), layouts[-1])


def pair_detected(record: dict) -> bool:
    """Whether a preference layout detects `record` (`pair_layout` falls back to TRL's when none does)."""
    return any(e.pair is not None and e.detect(record) for e in REGISTRY)


def unpaired_layout(record: dict) -> Optional[Format]:
    """The layout of a labelled KTO record: the first KTO entry with turns that detects it, or None."""
    return next((e for e in REGISTRY if "kto" in e.kinds and e.turns is not None and e.detect(record)), None)
