"""A folder that ships its own code (config.json `auto_map`) for a model_type transformers knows,
with trust_remote_code off (issue 32): it loads with the stock class and one warning when its
weights fit that class, and is refused in one line when they do not (tensors the stock class would
drop or start from random). The counts agree with transformers' own loading report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from pipeline.config import ModelConfig
from pipeline.modeling import models

AUTO_MAP = {
    "AutoConfig": "configuration_custom.CustomConfig",
    "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
}


def custom_copy(src: Path, folder: Path, rename: dict[str, str] | None = None) -> Path:
    """The tiny llama with an auto_map (the code files themselves are never read: trust is off),
    its tensors renamed by `rename` (a custom architecture's own names)."""
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(auto_map=AUTO_MAP, architectures=["CustomForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    if rename:
        state = load_file(folder / "model.safetensors")
        save_file(
            {rename.get(k, k): v for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"}
        )
    return folder


def test_fitting_weights_load_with_the_stock_class(tiny_model_dir, tmp_path):
    folder = custom_copy(tiny_model_dir, tmp_path / "fits")
    assert models.remote_code_problems(ModelConfig(path=str(folder))) == []
    assert "stock transformers class for model_type 'llama' is used" in models.warn_ignored_code(folder, False)


def test_weights_the_stock_class_cannot_hold_are_refused_in_one_line(tiny_model_dir, tmp_path):
    rename = {
        "model.layers.0.mlp.gate_proj.weight": "model.layers.0.mlp.w1.weight",
        "model.layers.1.mlp.gate_proj.weight": "model.layers.1.mlp.w1.weight",
    }
    folder = custom_copy(tiny_model_dir, tmp_path / "custom", rename)
    (problem,) = models.remote_code_problems(ModelConfig(path=str(folder)))
    assert problem == (
        f"model.path: {folder} ships its own code (auto_map) and its weights do not fit transformers' "
        "LlamaForCausalLM for model_type 'llama': 2 tensor(s) it has no place for (first: "
        "model.layers.0.mlp.w1.weight), 2 tensor(s) it would start from random (first: "
        "model.layers.0.mlp.gate_proj.weight); set model.trust_remote_code: true if you trust the folder"
    )
    # transformers' own report of the same load: the same tensors dropped and started from random
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == sorted(rename.values())
    assert sorted(info["missing_keys"]) == sorted(rename)
    assert models.remote_code_problems(ModelConfig(path=str(folder), trust_remote_code=True)) == []
    with pytest.raises(ValueError, match="its weights do not fit"):
        models.load_model(ModelConfig(path=str(folder), finetuning="full", dtype="fp32"), None)
