"""Preflight: is a model path what the command needs, checked from its files before anything loads.

    problems = model_problems(cfg.model.path, key="model.path", need="causal")

A wrong path otherwise surfaces as a transformers traceback (`Repo id must be in the form ...`,
"You need to have sentencepiece ... installed"), an adapter folder trains for minutes and then
fails in the merge, and a reward model given to chat or a causal LM given as PPO's reward model
loads without complaint. Each case here is one line naming the key, the path and the fix. Pure
file checks: no torch, no transformers model; `huggingface_hub` only for a hub id.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from pipeline.modeling.embedded import is_embedded

NEEDS = ("causal", "reward", "any")
ADAPTER_CONFIG = "adapter_config.json"
# A tokenizer needs its vocabulary: one of these (tokenizer_config.json alone is not one).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
SAFETENSORS_INDEX = "model.safetensors.index.json"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def model_kind_of(folder: Path) -> Optional[str]:
    """'reward' for a sequence classifier, 'causal' for a causal LM, None when unknown: the
    folder's manifest `model_kind` first, else config.json's `architectures`."""
    manifest = folder / "manifest.json"
    if manifest.is_file():
        try:
            kind = json.loads(manifest.read_text(encoding="utf-8")).get("model_kind")
        except (OSError, ValueError):
            kind = None
        if kind in ("causal", "reward"):
            return kind
    try:
        architectures = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "reward"
    if any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        return "causal"
    return None


def adapter_hint(folder: Path) -> str:
    """What to use instead of an adapter folder: its merged/ sibling when one exists."""
    sibling = folder.parent / "merged"
    if (sibling / "config.json").is_file():
        return f"use {sibling}"
    base = None
    try:
        base = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError):
        pass
    merge = f"relay merge --base {base or 'BASE'} --adapter {folder} --out {folder.parent / 'merged'}"
    return f"merge it first ({merge}) and use the merged folder"


def kind_problem(folder: Path, key: str, need: str) -> Optional[str]:
    """The wrong kind of model for `need` (a reward model where a causal LM is needed, or back)."""
    kind = model_kind_of(folder)
    if need == "any" or kind is None or kind == need:
        return None
    if need == "causal":
        return (
            f"{key}: {folder} is a reward model (a sequence classifier); this needs a causal language model, "
            "e.g. the SFT stage's merged/"
        )
    return (
        f"{key}: {folder} is a causal language model, not a reward model; give the RM stage's merged/ "
        "(a sequence classifier)"
    )


def folder_problems(folder: Path, key: str, need: str = "causal", allow_pickle: bool = False) -> list[str]:
    """What keeps an existing folder from loading as a model of kind `need` (pickled-only
    weights pass with `allow_pickle`: pipeline.modeling.models loads them weights_only)."""
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file():
        return [f"{key}: {folder} is a LoRA adapter, not a model; {adapter_hint(folder)}"]
    if not (folder / "config.json").is_file() and (folder / "checkpoints").is_dir():
        return [
            f"{key}: {folder} is an unfinished run (it has checkpoints/ but no merged/): rerun the command that "
            f"started it (its config is {folder / 'config.yaml'}) to finish it; it resumes from its last checkpoint"
        ]
    if not (folder / "config.json").is_file():
        return [f"{key}: {folder} has no config.json: not a Hugging Face model folder"]
    out = []
    names = {p.name for p in folder.iterdir()}
    if not any(n.endswith(".safetensors") for n in names) and SAFETENSORS_INDEX not in names:
        pickled = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")) and n != "training_args.bin")
        section = key.rsplit(".", 1)[0] if "." in key else "model"
        if not pickled:
            out.append(f"{key}: {folder} has no weights (no *.safetensors)")
        elif not allow_pickle:
            out.append(
                f"{key}: {folder} has only pickled weights ({', '.join(pickled[:3])}), and unpickling can run code; "
                "convert them to safetensors where you trust them (model.save_pretrained(folder, "
                f"safe_serialization=True)), or set {section}.allow_pickle: true to load them with "
                "torch.load(weights_only=True)"
            )
    if not names.intersection(TOKENIZER_VOCAB_FILES):
        out.append(
            f"{key}: {folder} has no tokenizer (none of {', '.join(TOKENIZER_VOCAB_FILES)}); copy the base "
            "model's tokenizer files into it"
        )
    problem = kind_problem(folder, key, need)
    return out + ([problem] if problem else [])


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_problems(repo_id: str, key: str, revision: Optional[str] = None) -> list[str]:
    """A hub id must be in the local cache (offline) or reachable (online)."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if isinstance(cached, str):
        return []
    if offline():
        return [
            f"{key}: {repo_id!r}: no such folder, and no hub model of that name in the local cache "
            f"(HF_HUB_OFFLINE=1); give a local folder, or download it first: hf download {repo_id}"
        ]
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(repo_id, revision=revision, timeout=10)
    except Exception as err:  # noqa: BLE001 - any failure means "not loadable from here"
        return [
            f"{key}: {repo_id!r} is no local folder and not a reachable hub model ({type(err).__name__}); "
            "check the spelling or give a local folder"
        ]
    return []


def model_problems(
    path: Optional[str],
    key: str = "model.path",
    need: str = "causal",
    revision: Optional[str] = None,
    allow_pickle: bool = False,
) -> list[str]:
    """Every problem with a model path, one line each ([] when it looks loadable).

    `need`: 'causal' (a language model), 'reward' (a sequence classifier) or 'any'. 'embedded'
    is always fine (Relay converts it itself).

    Raises:
        ValueError: an unknown `need`.
    """
    if need not in NEEDS:
        raise ValueError(f"need {need!r} is not one of {NEEDS}")
    if is_embedded(path):
        return []
    text = str(path)
    folder = Path(text).expanduser()
    if folder.is_dir():
        return folder_problems(folder, key, need, allow_pickle)
    if folder.exists():
        return [f"{key}: {text} is a file; give the model's folder"]
    if HUB_ID.match(text) and not text.startswith((".", "~")):
        return hub_problems(text, key, revision)
    return [f"{key}: {text}: no such folder"]
