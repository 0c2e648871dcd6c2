"""The serving backends: who answers `relay chat`, `relay serve` and the gold table's greedy decode
(pipeline/tools/gold.py), each entry carrying its own facts. The commands ask the entry instead of
comparing names; each keeps its own runtime table under the same keys (chat.CHAT_MODELS,
gold.GREEDY, serve.SERVERS; tests/test_backends.py checks). The RL stages' samplers are the other
registry, pipeline/config/backends.py. Imports no torch: the pipeline's config checks read it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

from pipeline.modeling import vllm_server


def _present() -> Optional[str]:
    return None


def _never() -> bool:
    return False


@dataclass(frozen=True)
class ServingBackend:
    label: str
    """How messages name it."""
    serve_name: str
    """Its `relay serve --backend` value."""
    sampling: tuple[str, ...]
    """The `relay chat` sampling flags it honours (a flag it lacks, set, is refused)."""
    aliases: tuple[str, ...] = ()
    """Other `relay serve --backend` values that name it (earlier names, kept working)."""
    serve_options: tuple[str, ...] = ()
    """`relay serve` switches only it reads (set on another backend: refused)."""
    in_cache_key: bool = True
    """The gold cache key names it (relay's rows were cached before backends existed and keep their key)."""
    missing: Callable[[], Optional[str]] = _present
    """Why it cannot run on this machine (not installed), or None."""
    preferred: Callable[[], bool] = _never
    """`relay serve --backend auto` takes it when this holds (the first such entry; else DEFAULT)."""


def _vllm_missing() -> Optional[str]:
    if vllm_server.vllm_python() is None:
        return "vllm is not installed (bash run_scripts/install_vllm.sh makes bench/.venv-vllm)"
    return None


def _vllm_importable() -> bool:
    return importlib.util.find_spec("vllm") is not None


SERVING: dict[str, ServingBackend] = {
    "relay": ServingBackend(
        "Relay",
        "relay",
        ("temperature", "top-p", "top-k", "repetition-penalty"),
        aliases=("transformers",),  # its name before it was the generation backends' 'relay'
        in_cache_key=False,
    ),
    "vllm": ServingBackend(
        "vLLM",
        "vllm",
        ("temperature", "top-p"),
        serve_options=("eager",),
        missing=_vllm_missing,
        preferred=_vllm_importable,
    ),
}
"""Serving backend -> its entry."""
DEFAULT = "relay"
"""Who answers when nothing is chosen (and `relay serve --backend auto` without a preferred entry)."""


def serve_choice(name: str) -> str:
    """The entry a `relay serve --backend` value names ('auto': the first preferred entry, else DEFAULT).

    Raises:
        KeyError: a value no entry serves as.
    """
    if name == "auto":
        return next((key for key, entry in SERVING.items() if entry.preferred()), DEFAULT)
    return {value: key for key, entry in SERVING.items() for value in (entry.serve_name, *entry.aliases)}[name]


def serve_values() -> tuple[str, ...]:
    """Every `relay serve --backend` value: auto, each entry's name, then the earlier names."""
    return ("auto", *(e.serve_name for e in SERVING.values()), *(a for e in SERVING.values() for a in e.aliases))
