"""What a LoRA adapter, or a LoRA config, asks of a base model that can be told before any weights load.

- `tied_lora_problems`: LoRA on a module whose weight the model ties to another (a tied output head
  and input embedding share one matrix). It trains, but its merge cannot be right: the update
  written into the shared matrix changes both modules, and the merge's check refuses the result.
  Training such a module in full (`lora.modules_to_save`) merges into a model with its own copy.
- `adapter_base_problem`: an adapter whose records name other base weights than the folder it is
  about to be merged into (`relay merge`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pipeline.config import LoraConfig
from pipeline.modeling.embedded import resolve_model_path
from pipeline.modeling.manifest import read_manifest, weights_hash


def tied_modules(model_folder: str | Path, kind: str = "causal", trust_remote_code: bool = False) -> dict[str, str]:
    """{module name: the module it shares its weight with} for the input and output embeddings of
    `model_folder`'s model class when its config ties them (tie_word_embeddings, the class's default
    when config.json leaves it out); {} when they are not tied, or there is no output embedding
    (a sequence classifier's head is its own). The class is built from the config on the meta
    device: no weights are read.

    Raises:
        OSError / ValueError: no readable config.json, or a model type transformers does not know
            (its code in the folder, without `trust_remote_code`).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(resolve_model_path(str(model_folder)), trust_remote_code=trust_remote_code)
    if not getattr(config.get_text_config(), "tie_word_embeddings", False):
        return {}
    auto = AutoModelForSequenceClassification if kind == "reward" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    if output is None or inputs is None:
        return {}
    names = {id(module): name for name, module in model.named_modules()}
    out_name, in_name = names[id(output)], names[id(inputs)]
    return {out_name: in_name, in_name: out_name}


def _targets(name: str, target: str) -> bool:
    """Whether a target_modules entry selects the module `name` (peft's rule for a list of names:
    the name itself or its last dotted parts)."""
    return name == target or name.endswith("." + target)


def tied_lora_problems(
    model_folder: str | Path, lora_cfg: LoraConfig, kind: str = "causal", trust_remote_code: bool = False
) -> list[str]:
    """One line per lora.target_modules entry that puts LoRA on a module whose weight the model at
    `model_folder` ('embedded' for the embedded model) ties to another (tied_modules); [] when none
    does, or when its config cannot be read (the model's own checks report that).
    `kind`: 'reward' for a sequence classifier built from the folder (the RM stage)."""
    try:
        tied = tied_modules(model_folder, kind, trust_remote_code)
    except (OSError, ValueError):
        return []
    problems = []
    for target in lora_cfg.target_modules:
        for module, partner in tied.items():
            if _targets(module, target):
                named = target if target == module else f"{target} ({module})"
                problems.append(
                    f"lora.target_modules: {named} shares its weight with {partner} "
                    f"(tie_word_embeddings: true in {model_folder}), so its LoRA update cannot be merged into the "
                    f"one matrix both use; train it in full with lora.modules_to_save: [{target}] (merged/ then "
                    "keeps its own copy) or leave it out of lora.target_modules"
                )
    return problems


def recorded_base(adapter: str | Path) -> Optional[tuple[str, str]]:
    """(weights hash, where it is recorded) of the base an adapter was trained on, from what can be
    read soundly; None when nothing can. In order:
    - its run's merged/manifest.json beside it, which a stage writes after the adapter, naming it as
      `adapter_path`, with `parent_hash` the weights hash of the base the run trained on (a manifest
      older than the adapter belongs to an earlier run and is not read);
    - adapter_config.json's `base_model_name_or_path` when it is an absolute path (a stage records
      `embedded` as its folder's) to a folder that holds safetensors: its weights now.
    A relative path (relative to a working directory not recorded), a hub id or a folder without
    safetensors is not compared."""
    adapter = Path(adapter)
    manifest_file = adapter.parent / "merged" / "manifest.json"
    weights = adapter / "adapter_model.safetensors"
    if manifest_file.is_file() and weights.is_file() and manifest_file.stat().st_mtime >= weights.stat().st_mtime:
        manifest = read_manifest(manifest_file.parent) or {}
        if manifest.get("parent_hash") and manifest.get("adapter_path") == str(adapter.resolve()):
            return manifest["parent_hash"], f"{manifest_file} parent_hash ({manifest.get('parent_path')})"
    try:
        named = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError):
        return None
    if isinstance(named, str) and Path(named).is_absolute() and weights_hash(named):
        return weights_hash(named), f"{adapter / 'adapter_config.json'} base_model_name_or_path {named}"
    return None


def adapter_base_problem(base: str, adapter: str) -> Optional[str]:
    """One line when the adapter's records (recorded_base) name other base weights than `base`
    ('embedded' for the embedded model) holds, compared by weights hash (sha256 of the safetensors
    files); None when they agree or cannot be compared."""
    recorded = recorded_base(adapter)
    given = weights_hash(resolve_model_path(base))
    if recorded is None or given is None or recorded[0] == given:
        return None
    return (
        f"--adapter {adapter} was trained on other weights than --base {base} holds ({recorded[1]}: weights "
        f"{recorded[0][:12]}; {base}: {given[:12]}); merged there it gives a model nobody trained: pass the base "
        "it was trained on"
    )
