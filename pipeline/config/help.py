"""`--help` for a stage config: every key once, grouped by section, with its default and docstring.

draccus's own help lists each section twice as a `--model str  Config file for model` option and
shows `--config_path`; this one is built from the same dataclasses and field docstrings.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from dataclasses import dataclass
from typing import Any, Optional

from draccus.wrappers.docstring import get_attribute_docstring


@dataclass(frozen=True)
class Habit:
    """Relay's key for another tool's option, and what differs."""

    key: str
    """A key of the stage configs (`config`: the config file option)."""
    note: str = ""
    """What the option means in Relay's terms, where that is more than a new name."""
    only: tuple[str, ...] = ()
    """The stages whose config has `key`, when not every stage's has it."""
    not_in: tuple[str, ...] = ()
    """The stages whose config lacks `key` (the other way of saying `only`)."""


_EPOCHS = "epochs are not steps: set the number of optimizer steps to run"
_DATA_FOLDER = "files, folders or globs; each entry is a task in SFT"

HABITS = {
    # TRL / transformers / LLaMA-Factory
    "model_name_or_path": Habit("model.path"),
    "model_name": Habit("model.path"),
    "model_path": Habit("model.path"),
    "dataset": Habit("data.train"),
    "train_file": Habit("data.train"),
    "dataset_name": Habit("data.train"),
    "learning_rate": Habit("train.learning_rate"),
    "num_train_epochs": Habit("train.max_steps", _EPOCHS),
    "max_steps": Habit("train.max_steps"),
    "per_device_train_batch_size": Habit("train.batch_size"),
    "gradient_accumulation_steps": Habit("train.grad_accum"),
    "max_seq_length": Habit("train.seq_length"),
    "max_length": Habit("train.seq_length"),
    "seed": Habit("train.seed"),
    "lora_r": Habit("lora.r"),
    "lora_alpha": Habit("lora.alpha"),
    "use_peft": Habit("model.finetuning", "lora or qlora"),
    "deepspeed": Habit("distributed.deepspeed_config"),
    "report_to": Habit("tracking.trackers"),
    "reward_model_path": Habit("reward_model.path", only=("ppo", "grpo")),
    # MFTCoder, MedicalGPT, Levanter
    "config_path": Habit("config", "a YAML or JSON config file"),
    "train_config": Habit("config", "a YAML or JSON config file"),
    "lora_rank": Habit("lora.r"),
    "qlora": Habit("model.finetuning", "set it to qlora: a 4-bit base with LoRA"),
    "load_in_4bit": Habit("model.finetuning", "set it to qlora: a 4-bit base with LoRA"),
    "load_in_8bit": Habit(
        "model.finetuning", "Relay has no 8-bit loading; qlora, a 4-bit base with LoRA, is its quantized option"
    ),
    "checkpointing_steps": Habit(
        "checkpoint.keep",
        "checkpoints every N steps are a keep rule, [{every: N}]; checkpoint.save_interval sets the "
        "temporary ones by time",
    ),
    "tb_dir": Habit("output_dir", "TensorBoard events go to <output_dir>/runs/; tracking.trackers picks the trackers"),
    "data_paths": Habit("data.train", _DATA_FOLDER),
    "train_file_dir": Habit("data.train", _DATA_FOLDER),
    "validation_file_dir": Habit("data.eval"),
    "validation_file": Habit("data.eval"),
    "weighted_loss_mode": Habit("multitask.weighted_loss_mode", only=("sft",)),
    "padding_mode": Habit("data.padding_mode", not_in=("pt",)),
    "role_markers": Habit("data.role_markers", "read with data.template role_markers", not_in=("pt",)),
    "seq_length": Habit("train.seq_length"),
    "block_size": Habit("train.seq_length"),
    "max_train_samples": Habit("data.max_samples"),
    "max_eval_samples": Habit(
        "train.eval_batches",
        "the held-out set is capped in batches, not records; data.max_samples caps only the training records",
    ),
    "validation_split_percentage": Habit("data.eval_fraction", "a fraction of the training data, not a percentage"),
}
"""Other tools' option names -> Relay's key (shown as "did you mean")."""


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
        "command line (later wins). Unknown keys are errors. A str key takes VALUE as typed (null leaves an",
        "optional one unset); other keys read it as YAML ([a, b] is a list).",
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
    """'did you mean' for a key from another tool's vocabulary (what differs, and the stages that
    have the key where not every stage does, in brackets), or None."""
    habit = HABITS.get(key.replace("-", "_"))
    if habit is None:
        return None
    notes = [habit.note] if habit.note else []
    if habit.only:
        notes.append(f"{' and '.join(habit.only)} only")
    if habit.not_in:
        notes.append(f"not in {' or '.join(habit.not_in)}")
    return f"did you mean '--{habit.key}'?" + (f" ({'; '.join(notes)})" if notes else "")
