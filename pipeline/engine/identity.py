"""What a checkpoint belongs to, and whether a run may resume it.

Every checkpoint's marker records the identity of the run that wrote it (`run_identity`):
- `stage`: the stage's name (a PT run never resumes an SFT folder);
- `fixed`: what the trained weights are (the parent model's weights hash, or its path when it
  has no manifest; fine-tuning mode; the LoRA shape). A change here cannot be resumed at all:
  the saved weights belong to another model;
- `config`: every resolved config key that shapes the training trajectory (learning rate and
  schedule, seq length, seed, the global batch, data settings, stage options...), a sha256 of
  every data file the steps train on (`data.train_files`, over the entries of the stage's
  `training_data` keys: data.train, and e.g. distill's data.completions), and the weights hash of
  each other model the steps read (`<key>:weights`, the stage's `input_models`: distill's
  teacher). A change is refused unless `checkpoint.resume_changed: true`, which
  applies the new values from the resumed step on and records that it did (the manifest's
  `resume_changes`);
- `may_change`: keys that can change between runs without changing what the steps compute or
  which samples they see: `train.max_steps` (the schedule follows the new total), the eval and
  log cadence, checkpoint and tracking settings, the split of the global batch into ranks x
  micro-batches x batch size (the data cursor counts samples, so the same samples follow), the
  distributed engine, gradient checkpointing, the held-out files. Changes are logged.

`compare` turns two identities into the lines a user reads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Iterable, Optional

from data_formats.sources import expand_entry
from pipeline.modeling.manifest import read_manifest, weights_hash

MAY_CHANGE = (
    "output_dir",
    "train.max_steps",
    "train.log_steps",
    "train.eval_steps",
    "train.eval_batches",
    "train.early_stopping_stall_num",
    "train.batch_size",
    "train.grad_accum",
    "checkpoint.",
    "tracking.",
    "distributed.",
    "model.gradient_checkpointing",
    "model.attn_implementation",
    "data.eval",
)
"""Dotted keys (or prefixes ending in '.') that may change on resume (see the module docstring)."""

FIXED = ("model.path", "model.finetuning", "lora.r", "lora.target_modules", "lora.modules_to_save")
"""Dotted keys that decide the shape and origin of the trained weights."""


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'a.b': value} for a nested dict (lists and empty dicts stay values)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def matches(key: str, patterns: Iterable[str]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in patterns)


TRAINING_DATA = ("data.train",)
"""The config keys whose files a stage trains on, unless it says otherwise (`Stage.training_data`)."""

WEIGHTS = ":weights"
"""Suffix of an identity key holding the weights of a model folder a stage reads beside its parent."""


def training_entries(config: dict, keys: Iterable[str] = TRAINING_DATA) -> list[str]:
    """The data entries the dotted `keys` of a nested config name, key after key."""
    out: list[str] = []
    for key in keys:
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out += list(node or [])
    return out


def data_digest(entries: Iterable[str]) -> str:
    """sha256 over the names and bytes of the files the data entries name (hub datasets by name)."""
    digest = hashlib.sha256()
    for entry in entries:
        files, dataset = expand_entry(entry)
        if dataset is not None:
            digest.update(f"dataset:{dataset}\n".encode())
        for file in files:
            digest.update(f"file:{file.name}\n".encode())
            if file.is_file():
                with open(file, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
    return digest.hexdigest()


def parent_identity(model_path: str) -> str:
    """The parent model's weights hash from its manifest, else its resolved path."""
    folder = Path(model_path)
    manifest = read_manifest(folder) if folder.is_dir() else None
    if manifest and manifest.get("weights_hash"):
        return f"weights {manifest['weights_hash']}"
    return str(folder.resolve()) if folder.exists() else str(model_path)


def model_identity(path: str) -> str:
    """A model folder a stage reads, as an identity records it: the hash of its weights as they are
    on disk (not its manifest's record: a folder overwritten in place keeps its manifest), else its
    resolved path (no safetensors)."""
    found = weights_hash(path)
    return f"weights {found}" if found else str(Path(path).resolve())


def run_identity(
    stage: str,
    config: dict,
    *,
    model_path: str,
    world_size: int,
    may_change: Iterable[str] = (),
    training_data: Iterable[str] = TRAINING_DATA,
    models: Optional[dict[str, str]] = None,
) -> dict:
    """The identity a checkpoint records (module docstring). `config` is the resolved config as
    a dict (pipeline.config.to_dict); `may_change` adds a stage's own keys to MAY_CHANGE;
    `training_data` are the config keys whose files the steps train on; `models` {config key:
    folder} the other models they read."""
    flat = flatten(config)
    loose = tuple(MAY_CHANGE) + tuple(may_change)
    fixed = {
        k: v
        for k, v in flat.items()
        if matches(k, FIXED) and not (k.startswith("lora.") and flat.get("model.finetuning") == "full")
    }
    fixed["model.path"] = parent_identity(model_path)
    train = config.get("train", {})
    shaping = {k: v for k, v in flat.items() if not matches(k, FIXED) and not matches(k, loose)}
    shaping["train.global_batch"] = int(train.get("batch_size", 1)) * int(train.get("grad_accum", 1)) * world_size
    shaping["data.train_files"] = data_digest(training_entries(config, training_data))
    shaping.update({f"{key}{WEIGHTS}": model_identity(path) for key, path in (models or {}).items()})
    return {
        "stage": stage,
        "fixed": fixed,
        "config": shaping,
        "may_change": {k: v for k, v in flat.items() if matches(k, loose) and not k.startswith("checkpoint.")},
    }


def changes(old: dict, new: dict) -> list[str]:
    """One line per key whose value differs between two flat ({dotted key: value}) records: the
    one definition of "changed" that resume (here) and the pipeline driver's staleness
    (pipeline.tools.chain.stage_status) both use."""
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key == "data.train_files":
                out.append("the training data files changed (their sha256 differs)")
            elif key.endswith(WEIGHTS):
                model = key[: -len(WEIGHTS)]
                out.append(f"the model at {model} changed: {old.get(key, '(absent)')} -> {new.get(key, '(absent)')}")
            else:
                out.append(f"{key}: {old.get(key, '(absent)')!r} -> {new.get(key, '(absent)')!r}")
    return out


def config_changes(old: dict, new: dict) -> list[str]:
    """`changes` between two nested configs."""
    return changes(flatten(old), flatten(new))


OUTPUT_NEUTRAL = ("checkpoint.", "tracking.", "train.log_steps")
"""Keys that never change what a finished stage trained (how it saved, resumed and logged: a
`checkpoint.resume_changed: true` the user added to resume is one): the pipeline does not call its
output stale for them."""


def output_changes(old: dict, new: dict) -> list[str]:
    """`config_changes` between the config a finished stage ran with and the one it would get now,
    leaving out OUTPUT_NEUTRAL keys."""

    def trained(tree: dict) -> dict:
        return {k: v for k, v in flatten(tree).items() if not matches(k, OUTPUT_NEUTRAL)}

    return changes(trained(old), trained(new))


def compare(saved: Optional[dict], current: dict) -> tuple[list[str], list[str], list[str]]:
    """(impossible, refused, allowed) differences between a checkpoint's identity and this run's:
    `impossible` can never be resumed (another stage, other weights), `refused` needs
    `checkpoint.resume_changed: true`, `allowed` is only logged."""
    if saved is None:
        return [], ["the checkpoint records no identity (written before Relay checked what it resumes)"], []
    if saved.get("stage") != current["stage"]:
        return [f"it was written by the {saved.get('stage')!r} stage, this is {current['stage']!r}"], [], []
    return (
        changes(saved.get("fixed", {}), current["fixed"]),
        changes(saved.get("config", {}), current["config"]),
        changes(saved.get("may_change", {}), current["may_change"]),
    )
