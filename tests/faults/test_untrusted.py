"""Untrusted model folders (issue 12, point 5): pickled weights are refused unless opted in and then
read with weights_only=True; `trust_remote_code: true` is honoured by every load, the merge
included; a folder whose custom code is ignored says so. Tiny models, CPU."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from stagerun import run_stage

from pipeline.config import ConfigError, ModelConfig
from pipeline.modeling import models

CONFIGURATION = """
from transformers import LlamaConfig


class RelayTinyConfig(LlamaConfig):
    model_type = "relay_tiny"
"""
MODELING = """
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

from .configuration_relaytiny import RelayTinyConfig


class RelayTinyForCausalLM(LlamaForCausalLM):
    config_class = RelayTinyConfig


class RelayTinyForSequenceClassification(LlamaForSequenceClassification):
    config_class = RelayTinyConfig
"""
AUTO_MAP = {
    "AutoConfig": "configuration_relaytiny.RelayTinyConfig",
    "AutoModelForCausalLM": "modeling_relaytiny.RelayTinyForCausalLM",
    "AutoModelForSequenceClassification": "modeling_relaytiny.RelayTinyForSequenceClassification",
}


from test_pt_sft import fresh_accelerate_state  # noqa: E402,F401 (autouse fixture: a fresh Accelerator, one thread)


@pytest.fixture(autouse=True)
def first_custom_code_warning():
    """Each test sees its own first ignored-custom-code warning."""
    getattr(models, "_warned_custom_code", set()).clear()


def with_custom_code(src: Path, folder: Path, model_type: str) -> Path:
    """A copy of the tiny model whose config.json maps the Auto classes to code in the folder
    (`auto_map`); model_type 'relay_tiny' exists only in that code, 'llama' is transformers' own."""
    shutil.copytree(src, folder)
    (folder / "configuration_relaytiny.py").write_text(CONFIGURATION)
    (folder / "modeling_relaytiny.py").write_text(MODELING)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, architectures=["RelayTinyForCausalLM"], auto_map=AUTO_MAP)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def sft_args(model: Path, tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"question {i}"},
                        {"role": "assistant", "content": f"answer {i}"},
                    ]
                }
            )
            + "\n"
            for i in range(8)
        )
    )
    return [
        "--model.path",
        str(model),
        "--data.train",
        f"[{data}]",
        "--data.eval",
        "[]",
        "--output_dir",
        str(tmp_path / "out"),
        "--train.seq_length",
        "48",
        "--train.batch_size",
        "2",
        "--train.max_steps",
        "2",
        "--train.eval_steps",
        "0",
        "--train.warmup",
        "0",
        "--lora.r",
        "4",
        "--tracking.trackers",
        "[]",
        "--checkpoint.save_interval",
        "1000h",
        *extra,
    ]


def test_trusted_custom_code_trains_and_merges(tiny_model_dir, tmp_path):
    """The merge used to reload with trust_remote_code=False and fail, on every restart."""
    from transformers import AutoModelForCausalLM

    from stages.sft import SFTStage

    folder = with_custom_code(tiny_model_dir, tmp_path / "custom", "relay_tiny")
    run_stage(SFTStage, sft_args(folder, tmp_path, "--model.trust_remote_code", "true"))
    merged = tmp_path / "out" / "merged"
    assert json.loads((merged / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"].endswith(
        "RelayTinyForCausalLM"
    )
    assert (merged / "modeling_relaytiny.py").is_file()  # the code travels with the merged model
    reloaded = AutoModelForCausalLM.from_pretrained(merged, trust_remote_code=True)
    assert type(reloaded).__name__ == "RelayTinyForCausalLM"


def test_untrusted_custom_code_is_refused_before_loading(tiny_model_dir, tmp_path):
    folder = with_custom_code(tiny_model_dir, tmp_path / "custom", "relay_tiny")
    (problem,) = models.remote_code_problems(ModelConfig(path=str(folder)))
    assert problem.startswith(f"model.path: {folder} needs its own code: model_type 'relay_tiny'")
    assert "set model.trust_remote_code: true" in problem
    assert models.remote_code_problems(ModelConfig(path=str(folder), trust_remote_code=True)) == []
    with pytest.raises(ValueError, match="needs its own code"):
        models.load_model(ModelConfig(path=str(folder), finetuning="full", dtype="fp32"), None)


def test_relay_chat_names_its_own_opt_in(tiny_model_dir, tmp_path):
    """relay chat's flag is --trust-remote-code; it advised a config key it does not read."""
    from pipeline.tools.chat import ChatError, load_chat_tokenizer

    folder = with_custom_code(tiny_model_dir, tmp_path / "custom", "relay_tiny")
    with pytest.raises(ChatError) as err:
        load_chat_tokenizer(str(folder))
    assert "pass --trust-remote-code if you trust the folder" in str(err.value)
    assert "trust_remote_code: true" not in str(err.value)


def test_ignored_custom_code_is_said_once(tiny_model_dir, tmp_path, caplog):
    """A known model_type with auto_map: the stock class loads, and the user is told so, once."""
    from stages.sft import SFTStage

    folder = with_custom_code(tiny_model_dir, tmp_path / "custom", "llama")
    with caplog.at_level(logging.WARNING, logger="pipeline.modeling.models"):
        run_stage(SFTStage, sft_args(folder, tmp_path))
    warnings = [r.getMessage() for r in caplog.records if "custom code" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0] == (
        f"{folder}: config.json maps AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification "
        "to custom code in the folder (auto_map); trust_remote_code is false, so that code is ignored "
        "and the stock transformers class for model_type 'llama' is used (set model.trust_remote_code: "
        "true if you trust the folder and need its code)"
    )
    merged = tmp_path / "out" / "merged"
    assert (merged / "model.safetensors").is_file()
    assert "auto_map" not in json.loads((merged / "config.json").read_text())  # no pointer to code it does not hold


def pickled_copy(src: Path, folder: Path) -> Path:
    """The tiny model with its weights as pytorch_model.bin (torch.save) instead of safetensors."""
    from safetensors.torch import load_file

    shutil.copytree(src, folder)
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    return folder


class Payload:
    """Unpickling this creates a file: what a hostile pytorch_model.bin could do instead."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_weights_need_opt_in_and_load_weights_only(tiny_model_dir, tmp_path):
    from pipeline.modeling.preflight import model_problems

    folder = pickled_copy(tiny_model_dir, tmp_path / "pickled")
    (problem,) = model_problems(str(folder), "model.path")
    assert problem.startswith(
        f"model.path: {folder} has only pickled weights (pytorch_model.bin), and unpickling can run code"
    )
    assert "set model.allow_pickle: true" in problem
    assert model_problems(str(folder), "model.path", allow_pickle=True) == []

    opted = ModelConfig(path=str(folder), finetuning="full", dtype="fp32", allow_pickle=True)
    assert models.from_pretrained_kwargs(opted)["weights_only"] is True
    loaded = models.load_model(opted, None)
    reference = models.load_model(ModelConfig(path=str(tiny_model_dir), finetuning="full", dtype="fp32"), None)
    for (name, a), (_, b) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name

    marker = tmp_path / "payload-ran"
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "extra": Payload(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(OSError):  # not opted in: the pickle is never opened
        models.load_model(ModelConfig(path=str(folder), finetuning="full", dtype="fp32"), None)
    with pytest.raises(Exception, match="(?i)weights_only|unpickl"):
        models.load_model(opted, None)
    assert not marker.exists()  # refused by weights_only=True, never executed


def test_opted_in_pickled_base_trains_and_merges(tiny_model_dir, tmp_path):
    """With model.allow_pickle the stage trains, and the merge loads the same pickled base."""
    from safetensors.torch import load_file

    from stages.sft import SFTStage

    folder = pickled_copy(tiny_model_dir, tmp_path / "pickled")
    run_stage(SFTStage, sft_args(folder, tmp_path, "--model.allow_pickle", "true"))
    merged = tmp_path / "out" / "merged"
    weights = load_file(merged / "model.safetensors")  # the merged folder is safetensors
    assert not list(merged.glob("*.bin"))
    base = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(weights[k], base[k]) for k in base if k in weights)  # the adapter was merged in


def test_pickled_weights_are_one_line_before_anything_heavy(tiny_model_dir, tmp_path, monkeypatch):
    """A stage given a pickle-only folder lists it with the other config problems: no tokenizer,
    no data, no model is loaded first."""
    from pipeline.config import load_config
    from stages.sft import SFTStage

    folder = pickled_copy(tiny_model_dir, tmp_path / "pickled")

    def never(*args, **kwargs):
        raise AssertionError("loaded something before refusing the pickled weights")

    monkeypatch.setattr(models, "load_tokenizer", never)
    monkeypatch.setattr(models, "load_model", never)
    with pytest.raises(ConfigError) as err:
        SFTStage(load_config(SFTStage.config_class, sft_args(folder, tmp_path))).validate()
    lines = [line for line in str(err.value).splitlines() if str(folder) in line]
    assert len(lines) == 1 and "pickled" in lines[0], str(err.value)


def test_chat_honours_trust_remote_code_and_allow_pickle(tiny_model_dir, tmp_path):
    """The tools load folders as the stages do: chat refuses a folder that needs its own code (one
    line) unless --trust-remote-code, and pickled-only weights unless --allow-pickle."""
    from pipeline.tools.chat import ChatError, load_chat_model

    custom = with_custom_code(tiny_model_dir, tmp_path / "custom", "relay_tiny")
    with pytest.raises(ChatError, match="needs its own code"):
        load_chat_model(str(custom))
    assert load_chat_model(str(custom), trust_remote_code=True) is not None
    pickled = pickled_copy(tiny_model_dir, tmp_path / "pickled")
    with pytest.raises(ChatError, match="allow_pickle"):
        load_chat_model(str(pickled))
    assert load_chat_model(str(pickled), allow_pickle=True) is not None
