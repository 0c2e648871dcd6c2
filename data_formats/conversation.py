"""Conversations and the record formats they are read from.

Every supported record format is parsed into one `Conversation` (SFT, prompts) or one pair of
them (preference data). Parsing never repairs anything: a record that does not fit its format
raises `RecordError` with a one-line reason, which the validator turns into `FILE:LINE: reason`.

Formats (detected per file from its first record, or named in the config's `format`):
  chatml      MFTCoder: {"id", "data_name", "chat_rounds": [{"role", "content"}]}
  messages    OpenAI:   {"messages": [{"role", "content"}]}
  sharegpt    ShareGPT: {"conversations": [{"from", "value"}]}  (human/gpt)
  alpaca      {"instruction", "input"?, "output"}; the user turn is the instruction, then a blank
              line and the input when the input is not empty (the Stanford Alpaca layout)
  pair        {"prompt","response"} | {"question","answer"} | {"input","output"}
  preference  {"prompt","chosen","rejected"} (strings or message lists) or MedicalGPT's
              {"question","response_chosen","response_rejected"}
  prompt      {"prompt"} (PPO prompts; any conversation format whose last turn is the user's also
              works)
  text        {"text"} raw documents (PT)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ROLES = ("system", "user", "assistant")
# Every spelling of a role we accept; anything else is an "unknown role" problem.
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "bot": "assistant",
    "gpt": "assistant",
}
CONVERSATION_FORMATS = ("chatml", "messages", "sharegpt", "alpaca", "pair")
FORMATS = CONVERSATION_FORMATS + ("preference", "prompt", "text")
PAIR_KEYS = (("prompt", "response"), ("question", "answer"), ("input", "output"))
# format -> (list field, role key, content key)
LIST_FORMATS = {
    "chatml": ("chat_rounds", "role", "content"),
    "messages": ("messages", "role", "content"),
    "sharegpt": ("conversations", "from", "value"),
}


class RecordError(ValueError):
    """A record that does not fit its format; the message is the one-line reason."""


@dataclass
class Turn:
    role: str
    """'system', 'user' or 'assistant'."""
    content: str


@dataclass
class Conversation:
    turns: list[Turn]
    task: str = "default"
    """Task name: the record's data_name if present, else the data path entry's name."""
    source: str = ""
    """Where the record came from, as 'file:line'."""
    meta: dict = field(default_factory=dict)
    """Extra record fields a stage may need (e.g. a preference margin)."""


def detect_format(record: Any) -> str:
    """The format a record looks like, from its keys.

    Raises:
        RecordError: the record is not a JSON object or matches no known format.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    keys = set(record)
    if "chat_rounds" in keys:
        return "chatml"
    if "chosen" in keys or "response_chosen" in keys:
        return "preference"
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if "instruction" in keys:
        return "alpaca"
    if "text" in keys and len(keys & {"prompt", "response", "question", "answer", "output"}) == 0:
        return "text"
    for a, b in PAIR_KEYS:
        if a in keys and b in keys:
            return "pair"
    if "prompt" in keys or "question" in keys:
        return "prompt"
    raise RecordError(f"unrecognised record format (keys: {', '.join(sorted(map(str, keys))) or 'none'})")


def _string(record: dict, key: str, *, allow_empty: bool = False) -> str:
    if key not in record:
        raise RecordError(f"missing field '{key}'")
    value = record[key]
    if not isinstance(value, str):
        raise RecordError(f"field '{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise RecordError(f"field '{key}' is empty")
    return value


def _turns(items: Any, key: str, role_key: str, content_key: str) -> list[Turn]:
    if not isinstance(items, list):
        raise RecordError(f"field '{key}' must be a list of turns, got {type(items).__name__}")
    if not items:
        raise RecordError(f"field '{key}' has no turns")
    turns = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RecordError(f"{key}[{i}]: a turn must be an object, got {type(item).__name__}")
        if role_key not in item:
            raise RecordError(f"{key}[{i}]: missing field '{role_key}'")
        if content_key not in item:
            raise RecordError(f"{key}[{i}]: missing field '{content_key}'")
        role = item[role_key]
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise RecordError(f"{key}[{i}]: unknown role {role!r}")
        content = item[content_key]
        if not isinstance(content, str):
            raise RecordError(f"{key}[{i}]: content must be a string, got {type(content).__name__}")
        if not content.strip():
            raise RecordError(f"{key}[{i}]: empty content")
        turns.append(Turn(ROLE_ALIASES[role.lower()], content))
    return turns


def check_order(turns: list[Turn], last: str) -> None:
    """Check the role order: an optional system turn first, then user and assistant alternating,
    starting with user and ending with `last` ('assistant' or 'user').

    Raises:
        RecordError: the first turn that breaks the order.
    """
    body = turns
    if turns and turns[0].role == "system":
        body = turns[1:]
    for i, turn in enumerate(body):
        index = i + (len(turns) - len(body))
        if turn.role == "system":
            raise RecordError(f"turn {index}: system turn must come first")
        expected = "user" if i % 2 == 0 else "assistant"
        if turn.role != expected:
            if i == 0:
                raise RecordError(f"turn {index}: conversation must start with a user turn, got {turn.role}")
            raise RecordError(f"turn {index}: two {turn.role} turns in a row")
    if not body:
        raise RecordError("conversation has no user turn")
    if body[-1].role != last:
        raise RecordError(f"last turn must be the {last}'s, got {body[-1].role}")


def parse_turns(record: dict, fmt: str, *, require_response: bool = True) -> list[Turn]:
    """The turns of a conversation record in format `fmt` (order not yet checked). Single-turn
    formats (alpaca, pair) need their response field unless `require_response` is False (prompts).

    Raises:
        RecordError: the record does not fit `fmt`.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    if fmt in LIST_FORMATS:
        key, role_key, content_key = LIST_FORMATS[fmt]
        if key not in record:
            raise RecordError(f"missing field '{key}'")
        return _turns(record[key], key, role_key, content_key)
    if fmt == "alpaca":
        instruction = _string(record, "instruction")
        extra = record.get("input", "")
        if not isinstance(extra, str):
            raise RecordError(f"field 'input' must be a string, got {type(extra).__name__}")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        turns = [Turn("user", user)]
        if require_response or "output" in record:
            turns.append(Turn("assistant", _string(record, "output")))
        return turns
    if fmt in ("pair", "prompt"):
        for a, b in PAIR_KEYS:
            if a in record:
                turns = [Turn("user", _string(record, a))]
                if (fmt == "pair" and require_response) or b in record:
                    turns.append(Turn("assistant", _string(record, b)))
                return turns
        raise RecordError("missing field 'prompt' (or 'question'/'input')")
    raise RecordError(f"format '{fmt}' does not hold a conversation")


def task_of(record: Any, default: str) -> str:
    """The task a record belongs to: its `data_name` when it is a non-empty string, else `default`
    (the data path entry's name)."""
    if isinstance(record, dict) and isinstance(record.get("data_name"), str) and record["data_name"].strip():
        return record["data_name"]
    return default


def parse_conversation(record: Any, fmt: str, *, last: str = "assistant", task: str = "default",
                       source: str = "", system_prompt: Optional[str] = None) -> Conversation:
    """A checked Conversation from one record. `last` is the role the conversation must end with
    ('assistant' for SFT, 'user' for prompts). `system_prompt` is added when there is no system turn.

    Raises:
        RecordError: the record does not fit `fmt` or its role order is wrong.
    """
    turns = parse_turns(record, fmt)
    check_order(turns, last)
    if system_prompt is not None and turns[0].role != "system":
        turns = [Turn("system", system_prompt)] + turns
    return Conversation(turns, task=task_of(record, task), source=source)


def _side(record: dict, key: str, prompt: list[Turn]) -> list[Turn]:
    value = record.get(key)
    if isinstance(value, list):
        turns = _turns(value, key, "role", "content")
        return prompt + turns if prompt else turns
    return prompt + [Turn("assistant", _string(record, key))]


def parse_preference(record: Any, *, task: str = "default", source: str = "",
                     system_prompt: Optional[str] = None) -> tuple[Conversation, Conversation]:
    """(chosen, rejected) conversations from a preference record.

    Accepted: {"prompt": str | [turns], "chosen": str | [turns], "rejected": ...} (message lists may
    hold the whole conversation, with or without a separate prompt), and MedicalGPT's
    {"question", "response_chosen", "response_rejected"} (optional "system").

    Raises:
        RecordError: missing or malformed fields, wrong role order, or identical sides.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    if "response_chosen" in record or "question" in record:
        prompt = [Turn("user", _string(record, "question"))]
        if isinstance(record.get("system"), str) and record["system"].strip():
            prompt.insert(0, Turn("system", record["system"]))
        chosen = prompt + [Turn("assistant", _string(record, "response_chosen"))]
        rejected = prompt + [Turn("assistant", _string(record, "response_rejected"))]
    else:
        prompt_value = record.get("prompt")
        if isinstance(prompt_value, list):
            prompt = _turns(prompt_value, "prompt", "role", "content")
        elif prompt_value is None and isinstance(record.get("chosen"), list):
            prompt = []
        else:
            prompt = [Turn("user", _string(record, "prompt"))]
        chosen = _side(record, "chosen", prompt)
        rejected = _side(record, "rejected", prompt)
    for turns in (chosen, rejected):
        check_order(turns, "assistant")
    if chosen == rejected:
        raise RecordError("chosen and rejected are identical")
    if system_prompt is not None and chosen[0].role != "system":
        chosen = [Turn("system", system_prompt)] + chosen
        rejected = [Turn("system", system_prompt)] + rejected
    name = task_of(record, task)
    return Conversation(chosen, name, source), Conversation(rejected, name, source)


def parse_text(record: Any, text_field: str = "text") -> str:
    """The document in a PT record.

    Raises:
        RecordError: the field is missing, not a string, or empty.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    return _string(record, text_field)
