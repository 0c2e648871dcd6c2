"""The stage-to-stage hand-off rule, in one place: what two model folders must agree on, and what
a folder must still agree on with its own manifest. The stage (its parent, before anything
loads), the RL stages (their reward model against the policy) and the pipeline driver (before and
after each stage) all call these functions, so the rule and its wording are one.

The facts are the tokenizer hash, the chat-template hash and the vocabulary size (`FACTS`); a
folder's *recorded* facts are its manifest's (what it was trained with), else computed from its
files. Every line shows both values. Cheap: reads JSON files only, imports no torch (the driver
calls it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from pipeline.modeling.manifest import (
    chat_template_of,
    read_manifest,
    text_hash,
    tokenizer_hash,
    tokenizer_length,
    vocab_size_of,
)

FACTS = {"tokenizer_hash": "tokenizer hash", "chat_template_hash": "chat template hash", "vocab_size": "vocab size"}
"""The facts two folders of one pipeline share, by manifest key, with the label a problem line uses."""


def folder_facts(folder: Union[str, Path]) -> dict[str, Any]:
    """What a model folder holds now, in manifest terms."""
    return {
        "tokenizer_hash": tokenizer_hash(folder),
        "chat_template_hash": text_hash(chat_template_of(folder)),
        "vocab_size": vocab_size_of(folder),
    }


def recorded_facts(folder: Union[str, Path]) -> dict[str, Any]:
    """What the folder was trained with: its manifest's record, else computed from its files."""
    manifest, now = read_manifest(folder) or {}, folder_facts(folder)
    return {key: manifest.get(key) or now[key] for key in FACTS}


def fact_problems(name_a: str, facts_a: dict, name_b: str, facts_b: dict) -> list[str]:
    """One line per fact whose values differ (pure)."""
    return [
        f"{label}: {name_a} has {facts_a.get(key)}, {name_b} has {facts_b.get(key)}"
        for key, label in FACTS.items()
        if facts_a.get(key) != facts_b.get(key)
    ]


def check_parent_compatible(parent: Union[str, Path], child_tokenizer_dir: Union[str, Path]) -> list[str]:
    """Mismatches between a parent model's recorded facts and the tokenizer a stage will use with
    it (empty when compatible), and a tokenizer larger than the model's vocabulary.

    Raises:
        FileNotFoundError: either folder does not exist.
    """
    parent, child = Path(parent), Path(child_tokenizer_dir)
    for folder in (parent, child):
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: no such folder")
    expected, found = recorded_facts(parent), folder_facts(child)
    if expected["vocab_size"] is None or found["vocab_size"] is None:  # nothing to compare the vocabulary with
        found["vocab_size"] = expected["vocab_size"]
    problems = fact_problems(f"parent {parent}", expected, str(child), found)
    child_len = tokenizer_length(child)
    if expected["vocab_size"] is not None and child_len is not None and child_len > expected["vocab_size"]:
        problems.append(
            f"vocab size: parent {parent} embeds {expected['vocab_size']} "
            f"tokens, the tokenizer in {child} has {child_len}"
        )
    return problems


def manifest_problems(folder: Union[str, Path], required: bool = True) -> list[str]:
    """The folder's tokenizer/template/vocab still match what its manifest recorded; without a
    manifest, one line when `required` (a stage's output), else nothing (a base model from elsewhere)."""
    if read_manifest(folder) is None:
        return (
            [f"{folder}: no manifest.json (not produced by Relay; cannot check what it inherits)"] if required else []
        )
    return check_parent_compatible(folder, folder)


def link_problems(child: Path, parent: Path, may_change_template: bool) -> list[str]:
    """A stage's output against its parent: tokenizer and vocab, and the chat template unless the
    stage may bring its own (SFT in role_markers mode saves its own Jinja)."""
    problems = check_parent_compatible(parent, child)
    return [p for p in problems if not p.startswith("chat template")] if may_change_template else problems


def pairing_problems(name_a: str, a: Union[str, Path], name_b: str, b: Union[str, Path]) -> list[str]:
    """Two folders one run uses together (a reward model scoring a policy's ids) share every fact."""
    return fact_problems(f"{name_a} {a}", folder_facts(a), f"{name_b} {b}", folder_facts(b))


def reward_pairing_problems(policy_path: str, reward_path: str) -> list[str]:
    """The policy and the reward model must tokenise identically (the RM scores policy ids)."""
    return [
        f"reward_model.path: the policy and the reward model do not share a tokenizer: {p}"
        for p in pairing_problems("policy", policy_path, "reward model", reward_path)
    ]
