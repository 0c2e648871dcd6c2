"""LLaMA-Factory's dataset registry (`dataset_info.json`): a data entry `FOLDER/dataset_info.json:NAME`
reads the registry's entry NAME as LLaMA-Factory's data/README.md documents it, so data kept for
LLaMA-Factory trains here unchanged.

    data:
      train: [data/dataset_info.json:alpaca_en_demo, data/dataset_info.json:glaive_toolcall_en_demo]

An entry's `file_name` (a file or folder beside the registry) is read as a data path entry is
(data_formats.sources), and each record is rewritten by the entry's `formatting`, `ranking`,
`columns` and `tags` into the layout Relay reads of that kind, then parsed through the format
registry (data_formats.formats) like any record: so a registry entry yields exactly what pointing
at its file yields when the file already has the layout the entry describes. The rewriting:

    alpaca, columns `prompt` only     {"text"} (LLaMA-Factory's pre-training description)
    alpaca                            {"instruction", "input", "output", "system"?, "history"?,
                                      "tools"?} (Relay's alpaca, whose reader takes LLaMA-Factory's
                                      system and history columns), for every record of the entry
    alpaca, ranking                   {"prompt", "chosen", "rejected"} (TRL's preference type), the
                                      prompt the messages of the system, history and question
    alpaca, a `kto_tag` column        {"messages"}: those turns and the answer
    sharegpt                          {"conversations": [{"from", "value"}], "system", "tools"},
                                      the entry's role tags mapped to ShareGPT's roles
    sharegpt, ranking                 the same plus {"chosen", "rejected"} messages
    a `kto_tag` column                its value as `label` (KTO records)

A record's `data_name` is kept (Relay's task name). Refused in one line naming the entry: hub
datasets (`hf_hub_url`, `ms_hub_url`, `om_hub_url`, `script_url`, `cloud_file_name`) while offline
(HF_HUB_OFFLINE or HF_DATASETS_OFFLINE), a hub dataset's `subset` or `folder`, multimodal columns
(`images`, `videos`, `audios`), `num_samples` (LLaMA-Factory draws them at random: use
data.max_samples), a `formatting` other than alpaca or sharegpt, and columns or tags LLaMA-Factory
does not document.

Not a `Format` of the format registry (data_formats/formats) but a kind of data entry beside files,
folders and datasets (data_formats.sources): a registry entry names a file and how its columns
map, and its records then go through the format registry's own layouts.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from data_formats.conversation import RecordError, json_type
from data_formats.formats.single_turn import alpaca_turns

REGISTRY_NAME = "dataset_info.json"
HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
ALPACA_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": None,
    "system": None,
    "tools": None,
    "chosen": None,
    "rejected": None,
    "kto_tag": None,
}
SHAREGPT_COLUMNS = {
    "messages": "conversations",
    "system": None,
    "tools": None,
    "chosen": None,
    "rejected": None,
    "kto_tag": None,
}
MEDIA_COLUMNS = ("images", "videos", "audios")
TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
SHAREGPT_ROLE = {
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
"""The ShareGPT role each tag's value becomes."""
KNOWN_KEYS = {
    "file_name",
    "formatting",
    "ranking",
    "subset",
    "split",
    "folder",
    "num_samples",
    "columns",
    "tags",
    *HUB_KEYS,
}


class RegistryError(ValueError):
    """A registry entry Relay cannot read: the message is the one line that says so."""


@dataclass(frozen=True)
class RegistryEntry:
    """One entry of a dataset_info.json, resolved."""

    entry: str
    """The data entry as written (`FOLDER/dataset_info.json:NAME`)."""
    name: str
    data: Optional[Path]
    """The file or folder `file_name` names (beside the registry), or None for a hub dataset."""
    hub: Optional[str]
    """`hf_hub_url[:split]` for a hub dataset read online, else None."""
    formatting: str
    ranking: bool
    columns: dict
    tags: dict


def split_entry(entry: str) -> Optional[tuple[Path, str]]:
    """(registry file, dataset name) when `entry` names a registry entry, else None."""
    path, sep, name = entry.rpartition(":")
    if not sep or not name or not Path(path).name.endswith(REGISTRY_NAME):
        return None
    return Path(path), name


def _offline() -> bool:
    return any(
        os.environ.get(key, "").strip().lower() in ("1", "true", "yes", "on")
        for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def resolve(entry: str) -> RegistryEntry:
    """The registry entry `entry` names, checked.

    Raises:
        RegistryError: a missing or unreadable registry, an unknown name, or an entry Relay cannot
            honour (module docstring), as one line naming the entry.
    """
    found = split_entry(entry)
    if found is None:
        raise RegistryError(f"{entry}: not a dataset_info.json entry (FOLDER/{REGISTRY_NAME}:NAME)")
    path, name = found

    def refuse(reason: str) -> RegistryError:
        return RegistryError(f"{entry}: {reason}")

    try:
        registry = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise refuse(f"no such file {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise refuse(f"{path} is not readable JSON ({err})") from None
    if not isinstance(registry, dict) or name not in registry:
        names = list(registry) if isinstance(registry, dict) else []
        close = difflib.get_close_matches(name, names, n=1)
        raise refuse(f"no entry {name!r} in {path}" + (f"; did you mean {close[0]!r}?" if close else ""))
    spec = registry[name]
    if not isinstance(spec, dict):
        raise refuse(f"the entry must be a JSON object, got {json_type(spec)}")
    unknown = sorted(set(spec) - KNOWN_KEYS)
    if unknown:
        raise refuse(f"unknown key(s) {unknown} (LLaMA-Factory's data/README.md lists the keys)")
    formatting = spec.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise refuse(f"formatting {formatting!r}: Relay reads LLaMA-Factory's alpaca and sharegpt formattings")
    columns, tags = spec.get("columns") or {}, spec.get("tags") or {}
    media = [c for c in MEDIA_COLUMNS if columns.get(c)]
    if media:
        raise refuse(f"multimodal column(s) {media}: Relay trains text-only language models")
    allowed = ALPACA_COLUMNS if formatting == "alpaca" else SHAREGPT_COLUMNS
    bad = sorted(set(columns) - set(allowed) - set(MEDIA_COLUMNS))
    if bad:
        raise refuse(f"column(s) {bad} are not {formatting} columns (known: {', '.join(allowed)})")
    bad = sorted(set(tags) - set(TAGS)) if formatting == "sharegpt" else sorted(tags)
    if bad:
        raise refuse(
            f"tag(s) {bad} are not "
            + ("sharegpt tags" if formatting == "sharegpt" else "used by the alpaca formatting")
        )
    if spec.get("num_samples") is not None:
        raise refuse("num_samples: LLaMA-Factory draws that many records at random; use data.max_samples (the first N)")
    hub = next((key for key in HUB_KEYS if spec.get(key)), None)
    data, hub_name = None, None
    if hub is not None:
        if hub != "hf_hub_url" or _offline():
            where = "offline (HF_HUB_OFFLINE)" if _offline() else "by Relay (only hf_hub_url is)"
            raise refuse(
                f"a hub dataset ({hub} {spec[hub]!r}) cannot be read {where}; download it and point "
                f"file_name at the local file"
            )
        if spec.get("subset") or spec.get("folder"):
            raise refuse(
                "a hub dataset's subset or folder is not read by Relay; download it and point file_name at the file"
            )
        hub_name = f"{spec[hub]}:{spec.get('split') or 'train'}"
    elif spec.get("file_name"):
        data = path.parent / str(spec["file_name"])
    else:
        raise refuse("no file_name (nor a hub dataset)")
    return RegistryEntry(entry, name, data, hub_name, formatting, bool(spec.get("ranking")), dict(columns), dict(tags))


def problem(entry: str) -> Optional[str]:
    """The one line refusing a registry entry, or None (also None for an entry of another kind)."""
    if split_entry(entry) is None:
        return None
    try:
        found = resolve(entry)
    except RegistryError as err:
        return str(err)
    if found.data is not None and not found.data.exists():
        return f"{entry}: its file_name {found.data} does not exist"
    return None


# ------------------------------------------------------------------------------------------
# Rewriting one record
# ------------------------------------------------------------------------------------------


def convert(record: Any, spec: RegistryEntry) -> dict:
    """The record in the layout Relay reads (module docstring).

    Raises:
        RecordError: the record is not an object or lacks a column the entry names.
    """
    if not isinstance(record, dict):
        raise RecordError(f"record must be a JSON object, got {json_type(record)}")
    out = _alpaca(record, spec) if spec.formatting == "alpaca" else _sharegpt(record, spec)
    if isinstance(record.get("data_name"), str):
        out["data_name"] = record["data_name"]
    return out


def _column(record: dict, spec: RegistryEntry, column: str, defaults: dict, required: bool = True) -> Any:
    key = spec.columns.get(column, defaults[column])
    if key is None:
        return None
    if key not in record:
        if required:
            raise RecordError(f"missing field {key!r} (the {column} column of {spec.entry})")
        return None
    return record[key]


def _alpaca(record: dict, spec: RegistryEntry) -> dict:
    """One alpaca record in one layout for the whole entry (a file's format is detected from its
    first record): Relay's alpaca, whose reader takes `system` and `history` as LLaMA-Factory's
    AlpacaDatasetConverter does; a ranking entry's {"prompt": messages, "chosen", "rejected"} and a
    KTO entry's {"messages", "label"} hold the same turns as messages."""
    get = lambda column, required=True: _column(record, spec, column, ALPACA_COLUMNS, required)  # noqa: E731
    if set(spec.columns) == {"prompt"}:
        return {"text": get("prompt")}
    single = {"instruction": get("prompt"), "input": get("query", False) or ""}
    for column in ("system", "history"):
        value = get(column, False)
        if value is not None:
            single[column] = value
    tools = get("tools", False)
    extra = {} if tools is None else {"tools": tools}
    if spec.ranking:
        return {"prompt": _messages(single), "chosen": get("chosen"), "rejected": get("rejected"), **extra}
    response = get("response", "response" in spec.columns)  # a renamed column must be there
    if response is not None:
        single["output"] = response
    if spec.columns.get("kto_tag") is None:
        return {**single, **extra}
    out: dict = {"messages": _messages(single), **extra}
    tag = get("kto_tag", False)
    if tag is not None:
        out["label"] = tag
    return out


def _messages(single: dict) -> list[dict]:
    """An alpaca record's turns (system, history, question and, when it has one, its answer) as messages."""
    return [{"role": t.role, "content": t.content} for t in alpaca_turns(single, False)]


def _sharegpt(record: dict, spec: RegistryEntry) -> dict:
    tags = {**TAGS, **spec.tags}
    role_of = {tags[tag]: role for tag, role in SHAREGPT_ROLE.items()}

    def message(item: Any, where: str) -> Any:
        if not isinstance(item, dict):
            return item  # the ShareGPT reader says what is wrong with it
        if tags["role_tag"] not in item or tags["content_tag"] not in item:
            raise RecordError(
                f"{where}: a message needs {tags['role_tag']!r} and {tags['content_tag']!r} (the tags of {spec.entry})"
            )
        role = item[tags["role_tag"]]
        return {"from": role_of.get(role, role), "value": item[tags["content_tag"]]}

    get = lambda column, required=True: _column(record, spec, column, SHAREGPT_COLUMNS, required)  # noqa: E731
    messages = get("messages")
    if not isinstance(messages, list):
        raise RecordError(f"the messages column of {spec.entry} must be a list of messages")
    out: dict = {"conversations": [message(m, spec.columns.get("messages", "conversations")) for m in messages]}
    for column in ("system", "tools"):
        value = get(column, False)
        if value is not None:
            out[column] = value
    if spec.ranking:
        out["chosen"], out["rejected"] = message(get("chosen"), "chosen"), message(get("rejected"), "rejected")
    tag = get("kto_tag", False)
    if tag is not None:
        out["label"] = tag
    return out
