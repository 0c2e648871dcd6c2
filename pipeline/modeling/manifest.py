"""`manifest.json`: what produced a model folder, so the next stage can check what it inherits.

Every merged folder (and the converted embedded model) carries one. What the next stage (and the
pipeline driver) checks against it is pipeline/modeling/handoff.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Optional, Union

from data_formats.cache import cache_root

MANIFEST = "manifest.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
WEIGHT_SUFFIXES = (".safetensors",)


def file_sha256(path: Union[str, Path]) -> str:
    """A file's sha256, as `sha256sum` prints it."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_files(paths: list[Path]) -> Optional[str]:
    if not paths:
        return None
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode())
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


_HASHES: dict[tuple, Any] = {}


def _remembered(kind: str, paths: list[Path], compute) -> Optional[str]:
    """`compute()`, remembered in this process while every file of `paths` is unchanged (same
    inode, size, modification and change times). A stage checks its parent's hashes, writes them into its
    manifest and the driver checks them again: one stage run asked for the same tokenizer's hash
    three times (0.8 s each: its JSON holds the whole vocabulary) and the same weights' twice."""
    stats = tuple(
        (str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for p in paths for st in [p.stat()]
    )
    key = (kind, stats)
    if key not in _HASHES:
        _HASHES[key] = compute()
    return _HASHES[key]


def weights_hash(folder: Union[str, Path]) -> Optional[str]:
    """sha256 over the folder's safetensors files (None when it has none, e.g. a hub id)."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    return _remembered("weights", files, lambda: _sha256_files(files)) if files else None


def tokenizer_hash(folder: Union[str, Path]) -> Optional[str]:
    """sha256 of the vocabulary and merges (tokenizer.json's `model` section, else the files).

    tokenizer_config.json is left out on purpose: it also holds cosmetic fields that
    save_pretrained rewrites, which would make identical tokenizers look different.
    """
    folder = Path(folder)
    tok_json = folder / "tokenizer.json"
    if tok_json.is_file():
        return _remembered("tokenizer.json", [tok_json], lambda: _tokenizer_json_hash(tok_json))
    files = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file() and n != "tokenizer_config.json"]
    return _remembered("tokenizer", files, lambda: _sha256_files(files)) if files else None


def _tokenizer_json_hash(path: Path) -> str:
    return _tokenizer_json_facts(path)[0]


def _tokenizer_json_facts(path: Path) -> tuple[str, Optional[int]]:
    """(tokenizer_hash, tokenizer_length) of a tokenizer.json, remembered in this process by the
    file's bytes: every stage saves its tokenizer into a new folder, byte for byte the parent's, and
    parsing and re-serialising the 49k-token vocabulary took ~0.8 s a time (a fifth of a tiny
    stage run in the test suite); hashing the bytes takes milliseconds. Across processes they are
    kept in $RELAY_CACHE/tokenizer_facts/, by the same bytes' sha256."""
    raw = path.read_bytes()
    content = hashlib.sha256(raw).hexdigest()
    key = ("tokenizer.json-content", content)
    if key not in _HASHES:
        _HASHES[key] = _stored_facts(content) or _store_facts(content, _parsed_facts(raw))
    return _HASHES[key]


def _parsed_facts(raw: bytes) -> tuple[str, Optional[int]]:
    data = json.loads(raw.decode("utf-8"))
    core = {"model": data.get("model"), "added_tokens": data.get("added_tokens")}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest(), _defined_tokens(data)


FACTS_VERSION = 1
"""Bump when `_parsed_facts` changes what it derives: records of another version are not read."""


def _facts_file(content: str) -> Path:
    return cache_root() / "tokenizer_facts" / f"{content}.v{FACTS_VERSION}.json"


def _stored_facts(content: str) -> Optional[tuple[str, Optional[int]]]:
    """The facts of a tokenizer.json with these bytes, kept on disk by an earlier process (each stage
    is a process of its own, and the suite starts ~40 of them on the same tokenizer), or None. A
    file that does not read as [hash, length] counts as absent."""
    try:
        digest, length = json.loads(_facts_file(content).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(digest, str) or not (length is None or isinstance(length, int)):
        return None
    return digest, length


def _store_facts(content: str, facts: tuple[str, Optional[int]]) -> tuple[str, Optional[int]]:
    """Keep `facts` for later processes (a read-only cache folder keeps nothing); returns them."""
    try:
        path = _facts_file(content)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(list(facts)), encoding="utf-8")
        tmp.replace(path)
    except OSError:
        pass
    return facts


def _defined_tokens(data: dict) -> Optional[int]:
    vocab = (data.get("model") or {}).get("vocab")
    # BPE/WordPiece store {token: id}; Unigram stores [[token, score], ...] in id order.
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab or [])))
    ids.update(token["id"] for token in data.get("added_tokens", []))
    return len(ids) if ids else None


def chat_template_of(folder: Union[str, Path]) -> Optional[str]:
    """The chat template a folder ships (chat_template.jinja or tokenizer_config.json), if any."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def text_hash(text: Optional[str]) -> Optional[str]:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "peft", "accelerate", "datasets", "trl", "relay"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def vocab_size_of(folder: Union[str, Path]) -> Optional[int]:
    config = Path(folder) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text(encoding="utf-8"))
    return data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")


def write_manifest(
    folder: Union[str, Path],
    *,
    stage: str,
    parent: Optional[str],
    config: Optional[dict] = None,
    adapter: Optional[str] = None,
    extra: Optional[dict[str, Any]] = None,
) -> dict:
    """Write `folder/manifest.json` describing the model saved in `folder`; return it."""
    folder = Path(folder)
    parent_manifest = read_manifest(parent) if parent and Path(parent).is_dir() else None
    manifest = {
        "stage": stage,
        "parent_path": str(Path(parent).resolve()) if parent and Path(parent).exists() else parent,
        "parent_hash": weights_hash(parent) if parent and Path(parent).is_dir() else None,
        "parent_stage": (parent_manifest or {}).get("stage"),
        "adapter_path": str(Path(adapter).resolve()) if adapter else None,
        "weights_hash": weights_hash(folder),
        "tokenizer_hash": tokenizer_hash(folder),
        "chat_template_hash": text_hash(chat_template_of(folder)),
        "vocab_size": vocab_size_of(folder),
        "config": config or {},
        "versions": library_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if extra:
        manifest.update(extra)
    (folder / MANIFEST).write_text(
        json.dumps(manifest, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8"
    )
    return manifest


def read_manifest(folder: Union[str, Path]) -> Optional[dict]:
    """The folder's manifest, or None when it has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def tokenizer_length(folder: Union[str, Path]) -> Optional[int]:
    """Number of tokens the folder's tokenizer.json defines (base vocabulary + added tokens), or
    None without a tokenizer.json. Read from the JSON so no tokenizer has to be built."""
    tok_json = Path(folder) / "tokenizer.json"
    if not tok_json.is_file():
        return None
    return _tokenizer_json_facts(tok_json)[1]
