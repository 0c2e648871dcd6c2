"""`--help` for a stage config: every key once, grouped by section, with its default and docstring.

draccus's own help lists each section twice as a `--model str  Config file for model` option and
shows `--config_path`; this one is built from the same dataclasses and field docstrings.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from typing import Any, Optional

from draccus.wrappers.docstring import get_attribute_docstring

# TRL / transformers / LLaMA-Factory habits -> Relay's key (shown as "did you mean").
HABITS = {
    "model_name_or_path": "model.path",
    "model_name": "model.path",
    "model_path": "model.path",
    "dataset": "data.train",
    "train_file": "data.train",
    "dataset_name": "data.train",
    "learning_rate": "train.learning_rate",
    "num_train_epochs": "train.max_steps",
    "max_steps": "train.max_steps",
    "per_device_train_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "max_seq_length": "train.seq_length",
    "max_length": "train.seq_length",
    "seed": "train.seed",
    "lora_r": "lora.r",
    "lora_alpha": "lora.alpha",
    "use_peft": "model.finetuning",
    "deepspeed": "distributed.deepspeed_config",
    "report_to": "tracking.trackers",
    "reward_model_path": "reward_model.path",
    "config_path": "config",
}


def _type_name(tp: Any) -> str:
    text = getattr(tp, "__name__", None) if not typing.get_args(tp) else None
    return text or str(tp).replace("typing.", "")


def _doc(cls: type, name: str) -> str:
    try:
        doc = get_attribute_docstring(cls, name)
    except Exception:  # noqa: BLE001 - a class without source (built dynamically): no docstring
        return ""
    return " ".join((doc.docstring_below or doc.comment_inline or doc.comment_above or "").split())


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return "" if dataclasses.is_dataclass(value) else repr(value)
    return "required"


def section_of(tp: Any) -> Optional[type]:
    """The dataclass a field holds (Optional[X] -> X), or None for a plain value."""
    if dataclasses.is_dataclass(tp):
        return tp
    return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)


def config_help(cls: type, prog: str, width: int = 100) -> str:
    """The help text of config class `cls` for the command `prog`."""
    hints = typing.get_type_hints(cls)
    top, sections = [], []
    for f in dataclasses.fields(cls):
        sub = section_of(hints[f.name])
        if sub is None:
            top.append((f.name, cls, f, hints[f.name]))
        else:
            sections.append((f.name, sub))
    lines = [
        f"usage: {prog} [--config FILE.yaml] [--section.key VALUE ...]",
        "",
        "Values come from the defaults below, then --config FILE.yaml, then --section.key VALUE on the",
        "command line (later wins). Unknown keys are errors.",
        "",
        "  --config FILE.yaml",
        "      a YAML file with any of the keys below (sections as mappings; !include allowed)",
    ]

    def emit(prefix: str, owner: type, f: dataclasses.Field, tp: Any) -> None:
        default = _default(f)
        head = f"  --{prefix}{f.name} {_type_name(tp)}" + (f"  (default {default})" if default else "")
        lines.append(head)
        doc = _doc(owner, f.name)
        if doc:
            lines.extend(textwrap.wrap(doc, width, initial_indent="      ", subsequent_indent="      "))

    for name, owner, f, tp in top:
        emit("", owner, f, tp)
    for name, sub in sections:
        lines += ["", f"{name}:"]
        sub_hints = typing.get_type_hints(sub)
        for f in dataclasses.fields(sub):
            emit(f"{name}.", sub, f, sub_hints[f.name])
    return "\n".join(lines)


def habit_hint(key: str) -> Optional[str]:
    """'did you mean' for a key from another tool's vocabulary, or None."""
    target = HABITS.get(key.replace("-", "_"))
    return f"did you mean '--{target}'?" if target else None
