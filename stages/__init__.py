"""The stage registry: every stage's name, script and class. The driver and the `relay` command
read this table, never the stage modules themselves (importing a stage loads torch and its
models; the table costs nothing). A new stage adds one line here (ARCHITECTURE.md)."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent

STAGES = {
    "pt": "pretrain:PTStage",
    "sft": "sft:SFTStage",
    "rm": "reward:RMStage",
    "ppo": "ppo:PPOStage",
}
"""name -> "module:class" under stages/."""


def script(name: str) -> Path:
    """The stage's script (what torchrun runs).

    Raises:
        KeyError: no such stage.
    """
    return ROOT / f"{STAGES[name].split(':')[0]}.py"


def stage_class(name: str):
    """The stage's class (imports its module).

    Raises:
        KeyError: no such stage.
    """
    module, cls = STAGES[name].split(":")
    return getattr(importlib.import_module(f"stages.{module}"), cls)


def config_class(name: str):
    """The stage's config dataclass."""
    return stage_class(name).config_class
