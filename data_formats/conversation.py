"""Conversations and the record formats they are read from.

Every supported record format is parsed into one `Conversation` (SFT, prompts) or one pair of
them (preference data). Parsing never repairs anything: a record that does not fit its format
raises `RecordError` with a one-line reason, which the validator turns into `FILE:LINE: reason`.

Formats (detected per file from its first record, or named in the config's `format`):
  chatml      MFTCoder: {"id", "data_name", "chat_rounds": [{"role", "content"}]}
  messages    OpenAI:   {"messages": [{"role", "content"}]}; assistant `tool_calls`, role `tool`
              and `tools` (data_formats.tools); content may also be a list of text parts
              ({"type": "text", "text"|"value"}, LLaMA-Factory's v1 records, with a `loss_weight`
              per turn only where it says what Relay trains anyway: 1 on assistant turns, else 0)
  sharegpt    ShareGPT: {"conversations": [{"from", "value"}]}  (human/gpt; function_call and
              observation with `tools`, data_formats.tools)
  alpaca      {"instruction", "input"?, "output"}; the user turn is the instruction, then a blank
              line and the input when the input is not empty (the Stanford Alpaca layout)
  pair        {"prompt","response"} | {"question","answer"} | {"input","output"}
  preference  {"prompt","chosen","rejected"} (strings or message lists), the same with the prompt
              as `conversations` or `messages` and each answer a string, one turn or a list
              (MedicalGPT, LLaMA-Factory; `tools` allowed), {"chosen_messages", "rejected_messages"}
              (LLaMA-Factory v1), or MedicalGPT's {"question","response_chosen","response_rejected"}
  prompt      {"prompt"} (PPO prompts; any conversation format whose last turn is the user's also
              works)
  text        {"text"} raw documents (PT)
  firefly, prompt_completion, and the preference layouts of HH-RLHF and OpenAI: data_formats.public
OpenAI's per-message `weight` (0 or 1 on assistant messages) sets `Turn.trained`; a `developer`
turn is a system turn; a system turn may be followed directly by the assistant's (OpenAI allows it).

Refused with one line saying why and what to do, whatever the kind: records with images, audio or
video (a text-only trainer would train on the placeholders), LLaMA-Factory's unfilled identity
placeholders ({{name}}, {{author}}), KTO records (a `label` of true/false on one answer: the KTO
stage's kind, data_formats.unpaired), reasoning parts, and LLaMA-Factory's dataset_info.json registry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from data_formats.tools import ToolRecordError, parse_calls, parse_tools

ROLES = ("system", "user", "assistant", "tool")
# Every spelling of a role we accept; anything else is an "unknown role" problem. ShareGPT's
# function_call is an assistant turn whose value is the call (data_formats.tools).
ROLE_ALIASES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system turn
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "bot": "assistant",
    "gpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
MEDIA_FIELDS = ("images", "audios", "videos")
PLACEHOLDERS = ("{{name}}", "{{author}}")
CONVERSATION_FORMATS = ("chatml", "messages", "sharegpt", "alpaca", "pair", "firefly", "prompt_completion")
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
    """'system', 'user', 'assistant' or 'tool' (a tool's result)."""
    content: str
    tool_calls: Optional[list[dict]] = None
    """An assistant turn's tool calls [{"name", "arguments": dict, "id"?}] (data_formats.tools)."""
    tool_call_id: Optional[str] = None
    """A tool turn's call id, when the record gives one."""
    trained: bool = True
    """Whether an assistant turn is trained (False: OpenAI's `weight` 0, kept as context only)."""


@dataclass
class Conversation:
    turns: list[Turn]
    task: str = "default"
    """Task name: the record's data_name if present, else the data path entry's name."""
    source: str = ""
    """Where the record came from, as 'file:line'."""
    meta: dict = field(default_factory=dict)
    """Extra record fields a stage may need (e.g. a prompt record's answer for reward functions)."""
    tools: Optional[list[dict]] = None
    """The tool schemas the conversation may call (data_formats.tools)."""
    standard: bool = False
    """A prompt record that gave its prompt as a plain text (TRL's standard type, not messages):
    GRPO's reward functions then get the prompt and completions as strings, as TRL passes them."""


def detect_format(record: Any) -> str:
    """The format a record looks like, from its keys.

    Raises:
        RecordError: the record is not a JSON object or matches no known format.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    refuse_unsupported(record)
    keys = set(record)
    from data_formats.public import refuse_unusable

    refuse_unusable(keys)
    if "chat_rounds" in keys:
        return "chatml"
    if keys & {"chosen", "response_chosen", "chosen_messages", "preferred_output"}:
        return "preference"
    if "conversation" in keys:
        return "firefly"
    if "completion" in keys and "prompt" in keys and "label" not in keys:
        return "prompt_completion"
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


_REGISTRY_KEYS = ("file_name", "hf_hub_url", "ms_hub_url", "script_url", "om_hub_url")
_MEDIA_PARTS = ("image", "image_url", "audio", "audio_url", "input_audio", "video", "video_url")


def _media(what: str) -> RecordError:
    return RecordError(f"multimodal record ({what}): Relay trains text-only language models; remove the media and their "
                       "<image>/<audio>/<video> placeholders, or train this data with a multimodal trainer")


def refuse_unsupported(record: dict) -> None:
    """Refuse what Relay cannot train whatever the kind (see the module docstring).

    Raises:
        RecordError: images/audio/video fields, or LLaMA-Factory's dataset registry.
    """
    for key in MEDIA_FIELDS:
        if record.get(key):
            raise _media(f"field '{key}'")
    if record and all(isinstance(v, dict) and any(k in v for k in _REGISTRY_KEYS) for v in record.values()):
        raise RecordError("this is LLaMA-Factory's dataset registry (dataset_info.json), not training records: "
                          "point Relay at the data files it names")


def _content(value: Any, where: str) -> tuple[str, list[dict]]:
    """(text, calls) of a turn's content: a string, null (a call without text), or a list of
    parts: text parts joined, v1 `tool_call` parts read as calls; anything else refused."""
    if value is None:
        return "", []
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise RecordError(f"{where}: content must be a string, got {type(value).__name__}")
    texts, calls = [], []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise _media(f"a '{kind}' content part")
        if kind == "reasoning":
            raise RecordError("a 'reasoning' content part (LLaMA-Factory v1 reasoning data); Relay trains answers, not "
                              "separate reasoning traces: drop the reasoning parts, or write them into the answer text")
        text = part.get("text", part.get("value")) if isinstance(part, dict) else None
        if kind not in ("text", "tool_call") or not isinstance(text, str):
            raise RecordError(f"{where}: content part {j} is not a text part ({{'type': 'text', 'text': ...}})")
        if kind == "tool_call":
            calls += _calls(text, f"{where}: content part {j}")
        else:
            texts.append(text)
    return "".join(texts), calls


def _calls(value: Any, where: str) -> list[dict]:
    try:
        return parse_calls(value, where)
    except ToolRecordError as err:
        raise RecordError(str(err)) from None


def _loss_weight(item: dict, role: str) -> None:
    """A v1 `loss_weight` is accepted only where it says what Relay trains anyway."""
    if "loss_weight" not in item:
        return
    want = 1.0 if role == "assistant" else 0.0
    if item["loss_weight"] != want:
        raise RecordError(f"loss_weight {item['loss_weight']!r} on a turn of the {role}; Relay trains every assistant "
                          "turn (weight 1) and nothing else (weight 0): drop the field or the turn")


def _turn(item: Any, where: str, role_key: str, content_key: str) -> Turn:
    """One turn of a list format (see the module docstring)."""
    if not isinstance(item, dict):
        raise RecordError(f"{where}: a turn must be an object, got {type(item).__name__}")
    if role_key not in item:
        raise RecordError(f"{where}: missing field '{role_key}'")
    raw_role = item[role_key]
    if not isinstance(raw_role, str) or raw_role.lower() not in ROLE_ALIASES:
        raise RecordError(f"{where}: unknown role {raw_role!r}")
    role = ROLE_ALIASES[raw_role.lower()]
    if content_key not in item and not (role == "assistant" and item.get("tool_calls")):  # OpenAI: a call may omit it
        raise RecordError(f"{where}: missing field '{content_key}'")
    _loss_weight(item, role)
    if raw_role.lower() == "function_call":
        if not isinstance(item[content_key], str):
            raise RecordError(f"{where}: content must be a string, got {type(item[content_key]).__name__}")
        return Turn("assistant", "", tool_calls=_calls(item[content_key], f"{where}: function_call"))
    content, calls = _content(item.get(content_key), where)
    if item.get("tool_calls") and role == "assistant":
        calls += _calls(item["tool_calls"], f"{where}: tool_calls")
    if calls and role != "assistant":
        raise RecordError(f"{where}: a {role} turn cannot call tools")
    if not calls and not content.strip():
        raise RecordError(f"{where}: empty content")
    call_id = item.get("tool_call_id") if role == "tool" and isinstance(item.get("tool_call_id"), str) else None
    return Turn(role, content, tool_calls=calls or None, tool_call_id=call_id, trained=_weight(item, role, where))


def _weight(item: dict, role: str, where: str) -> bool:
    """OpenAI's per-message `weight`: 1 trains an assistant message (the default), 0 keeps it as context."""
    if "weight" not in item:
        return True
    if role != "assistant" or item["weight"] not in (0, 1) or isinstance(item["weight"], bool):
        raise RecordError(f"{where}: 'weight' {item['weight']!r} on a {role} turn; OpenAI's weight is 0 or 1 on an "
                          "assistant message (0: not trained)")
    return item["weight"] == 1


def _turns(items: Any, key: str, role_key: str, content_key: str) -> list[Turn]:
    if not isinstance(items, list):
        raise RecordError(f"field '{key}' must be a list of turns, got {type(items).__name__}")
    if not items:
        raise RecordError(f"field '{key}' has no turns")
    return [_turn(item, f"{key}[{i}]", role_key, content_key) for i, item in enumerate(items)]


# After each role, the roles that may follow it (an assistant turn that calls tools: its results).
_NEXT = {"user": ("assistant",), "assistant": ("user",), "tool": ("tool", "assistant")}


def check_order(turns: list[Turn], last: str) -> None:
    """Check the role order: an optional system turn first, then user and assistant alternating,
    starting with user and ending with `last` ('assistant' or 'user'); an assistant turn that calls
    tools is followed by their results (tool turns), which are followed by the assistant's turn.
    A prompt (`last` 'user') may also end with tool results.

    Raises:
        RecordError: the first turn that breaks the order.
    """
    body = turns
    if turns and turns[0].role == "system":
        body = turns[1:]
    offset = len(turns) - len(body)
    for i, turn in enumerate(body):
        index = i + offset
        if turn.role == "system":
            raise RecordError(f"turn {index}: system turn must come first")
        if i == 0:
            if turn.role != "user" and not (turn.role == "assistant" and offset):  # OpenAI allows system, assistant
                raise RecordError(f"turn {index}: conversation must start with a user turn, got {turn.role}")
            continue
        previous = body[i - 1]
        allowed = ("tool",) if previous.tool_calls else _NEXT[previous.role]
        if turn.role in allowed:
            continue
        if previous.tool_calls:
            raise RecordError(f"turn {index}: a tool call must be followed by its result (a tool/observation turn), got {turn.role}")
        if turn.role == "tool":
            raise RecordError(f"turn {index}: a tool result must follow the assistant's tool call")
        if previous.role == "tool":
            raise RecordError(f"turn {index}: a tool result must be followed by the assistant's turn, got {turn.role}")
        raise RecordError(f"turn {index}: two {turn.role} turns in a row")
    if not body:
        raise RecordError("conversation has no user turn")
    ends = (last, "tool") if last == "user" else (last,)
    if body[-1].role not in ends:
        raise RecordError(f"last turn must be the {last}'s, got {body[-1].role}")


def check_placeholders(turns: list[Turn]) -> None:
    """Refuse LLaMA-Factory's identity placeholders left unfilled (training would teach them).

    Raises:
        RecordError: a turn holds {{name}} or {{author}}.
    """
    for turn in turns:
        found = [p for p in PLACEHOLDERS if p in turn.content]
        if found:
            raise RecordError(f"unfilled placeholder {found[0]} (LLaMA-Factory's identity.json): replace {{{{name}}}} and "
                              "{{author}} with your model's name and maker before training")


def record_tools(record: dict) -> Optional[list[dict]]:
    """The record's tool schemas (`tools`), or None.

    Raises:
        RecordError: a malformed `tools` field.
    """
    value = record.get("tools")
    if value in (None, "", []):
        return None
    try:
        return parse_tools(value)
    except ToolRecordError as err:
        raise RecordError(str(err)) from None


def parse_turns(record: dict, fmt: str, *, require_response: bool = True) -> list[Turn]:
    """The turns of a conversation record in format `fmt` (order not yet checked). Single-turn
    formats (alpaca, pair) need their response field unless `require_response` is False (prompts).

    Raises:
        RecordError: the record does not fit `fmt`.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    refuse_unsupported(record)
    if fmt in LIST_FORMATS:
        key, role_key, content_key = LIST_FORMATS[fmt]
        if key not in record:
            raise RecordError(f"missing field '{key}'")
        return _record_system(record) + _turns(record[key], key, role_key, content_key)
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
    from data_formats import public

    if fmt == "firefly":
        return public.firefly_turns(record)
    if fmt == "prompt_completion" or (fmt == "prompt" and isinstance(record.get("prompt"), list)):
        return public.prompt_completion_turns(record, require_response and fmt == "prompt_completion")
    if fmt in ("pair", "prompt"):
        for a, b in PAIR_KEYS:
            if a in record:
                turns = [Turn("user", _string(record, a))]
                if (fmt == "pair" and require_response) or b in record:
                    turns.append(Turn("assistant", _string(record, b)))
                return turns
        raise RecordError("missing field 'prompt' (or 'question'/'input')")
    raise RecordError(f"format '{fmt}' does not hold a conversation")


def _record_system(record: dict) -> list[Turn]:
    """A top-level `system` string (LLaMA-Factory's system column) as the first turn."""
    value = record.get("system")
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    if not isinstance(value, str):
        raise RecordError(f"field 'system' must be a string, got {type(value).__name__}")
    return [Turn("system", value)]


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
        RecordError: the record does not fit `fmt`, its role order is wrong, or it is KTO data
            (data_formats.unpaired reads that).
    """
    if isinstance(record, dict) and isinstance(record.get("label"), bool):
        raise RecordError("a true/false 'label' on one answer (KTO data): train it with the KTO stage (stages/kto.py), "
                          "or its label=true records with SFT")
    turns = parse_turns(record, fmt)
    check_order(turns, last)
    check_placeholders(turns)
    if system_prompt is not None and turns[0].role != "system":
        turns = [Turn("system", system_prompt)] + turns
    return Conversation(turns, task=task_of(record, task), source=source, tools=record_tools(record))


def _side(record: dict, key: str, prompt: list[Turn]) -> list[Turn]:
    """One answer of a preference record after its prompt: a string, one turn, or a list of turns
    (which may hold the whole conversation when there is no separate prompt)."""
    value = record.get(key)
    if isinstance(value, list):
        sharegpt = bool(value) and isinstance(value[0], dict) and "from" in value[0]
        turns = _turns(value, key, *(("from", "value") if sharegpt else ("role", "content")))
        return prompt + turns if prompt else turns
    if isinstance(value, dict):
        return prompt + [_turn(value, key, *(("from", "value") if "from" in value else ("role", "content")))]
    return prompt + [Turn("assistant", _string(record, key))]


def _preference_prompt(record: dict) -> list[Turn]:
    """The shared prompt of a {prompt|conversations|messages, chosen, rejected} record ([] when the
    answers hold whole conversations)."""
    from data_formats.public import whole_conversations

    if whole_conversations(record):
        return []
    if isinstance(record.get("conversations"), list):
        return _record_system(record) + _turns(record["conversations"], "conversations", "from", "value")
    if isinstance(record.get("messages"), list):
        return _record_system(record) + _turns(record["messages"], "messages", "role", "content")
    prompt_value = record.get("prompt")
    if isinstance(prompt_value, list):
        return _turns(prompt_value, "prompt", "role", "content")
    if prompt_value is None and isinstance(record.get("chosen"), str):
        from data_formats.public import implicit_prompt_text

        raise implicit_prompt_text()
    return [Turn("user", _string(record, "prompt"))]


def check_shared_prompt(chosen: list[Turn], rejected: list[Turn], chosen_key: str, rejected_key: str) -> None:
    """Check that two sides given as whole conversations ask the same question: equal up to and
    including their last user turn (what follows it is the answer, tool calls included). A pair
    whose sides differ there compares answers to different prompts, which no preference loss can
    learn from (TRL's `extract_prompt` would keep only their common opening as the prompt).

    Raises:
        RecordError: the first turn where the two prompts differ.
    """
    def prompt(turns: list[Turn]) -> list[Turn]:
        last_user = max((i for i, t in enumerate(turns) if t.role == "user"), default=-1)
        return turns[:last_user + 1]

    mine, theirs = prompt(chosen), prompt(rejected)
    if mine == theirs:
        return
    at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    raise RecordError(f"'{chosen_key}' and '{rejected_key}' differ at turn {at}, before the answer: the two sides of a "
                      f"preference pair must share their prompt up to the last user turn (drop the record, or fix the side "
                      f"that asks another question)")


def parse_preference(record: Any, *, task: str = "default", source: str = "",
                     system_prompt: Optional[str] = None) -> tuple[Conversation, Conversation]:
    """(chosen, rejected) conversations from a preference record (formats: the module docstring).
    The answers may be tool calls, and the prompt may end with tool results.

    Raises:
        RecordError: missing or malformed fields, wrong role order, or identical sides.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    refuse_unsupported(record)
    from data_formats import public

    tools = record_tools(record)
    whole: Optional[tuple[str, str]] = None  # the keys of sides that each hold the whole conversation
    if public.is_openai_preference(record):
        chosen, rejected, tools = public.openai_preference(record)
    elif public.is_hh(record) and "prompt" not in record:
        chosen, rejected = public.hh_pair(record)
    elif public.is_hh_prompt(record):
        chosen, rejected = public.hh_prompt_pair(record)
    elif "response_chosen" in record or "question" in record:
        prompt = [Turn("user", _string(record, "question"))]
        if isinstance(record.get("system"), str) and record["system"].strip():
            prompt.insert(0, Turn("system", record["system"]))
        chosen = prompt + [Turn("assistant", _string(record, "response_chosen"))]
        rejected = prompt + [Turn("assistant", _string(record, "response_rejected"))]
    elif "chosen_messages" in record:
        chosen = _turns(record["chosen_messages"], "chosen_messages", "role", "content")
        rejected = _turns(record.get("rejected_messages"), "rejected_messages", "role", "content")
        whole = ("chosen_messages", "rejected_messages")
    else:
        prompt = _preference_prompt(record)
        chosen = _side(record, "chosen", prompt)
        rejected = _side(record, "rejected", prompt)
        whole = ("chosen", "rejected") if not prompt else None
    for turns in (chosen, rejected):
        check_order(turns, "assistant")
        check_placeholders(turns)
        if not turns[-1].trained:
            raise RecordError("the compared answer has 'weight' 0; a preference pair compares trained answers")
    if whole:
        check_shared_prompt(chosen, rejected, *whole)
    if chosen == rejected:
        raise RecordError("chosen and rejected are identical")
    if system_prompt is not None and chosen[0].role != "system":
        chosen = [Turn("system", system_prompt)] + chosen
        rejected = [Turn("system", system_prompt)] + rejected
    name = task_of(record, task)
    return Conversation(chosen, name, source, tools=tools), Conversation(rejected, name, source, tools=tools)


def parse_text(record: Any, text_field: str = "text") -> str:
    """The document in a PT record.

    Raises:
        RecordError: the field is missing, not a string, or empty.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {type(record).__name__}")
    return _string(record, text_field)
