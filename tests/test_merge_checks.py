"""What `relay merge` / merge_adapter refuse or keep, on tiny models: an --out that is or holds the
adapter or the base (refused before anything is deleted), an adapter whose records name other base
weights, the base's dtype kept (a bf16 base merges into bf16), and LoRA on a tied module refused from
the config alone (pipeline/modeling/adapter_checks.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from tinymodels import make_tiny_model
from transformers import AutoModelForCausalLM

import pipeline.modeling.merge as merge
from pipeline.config import LoraConfig, ModelConfig
from pipeline.modeling.adapter_checks import adapter_base_problem, tied_lora_problems
from pipeline.modeling.merge import MergeError, merge_adapter
from pipeline.modeling.models import load_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_adapter(base, out, seed: int = 0, **lora) -> str:
    """A LoRA adapter of `base` with its trainable tensors perturbed ('trained'); its folder."""
    config = LoraConfig(r=4, alpha=8, dropout=0.0, **({"target_modules": ["q_proj", "v_proj"]} | lora))
    model = load_model(ModelConfig(path=str(base), finetuning="lora"), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """(base, run folder with adapter/ inside) for a LoRA adapter of the tiny model."""
    folder = tmp_path_factory.mktemp("merge-run") / "run"
    make_adapter(tiny_model_dir, folder / "adapter")
    return tiny_model_dir, folder


def listing(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("where", ["run", "adapter", "base", "above base"])
def test_an_out_that_is_or_holds_the_adapter_or_the_base_is_refused_before_anything_is_deleted(
    run, tmp_path, where, capsys
):
    """`relay merge --out RUN --overwrite` deleted the run, its adapter included, and left a merged
    model whose manifest names an adapter that no longer exists."""
    tiny, original = run
    base = tmp_path / "bases" / "base"
    shutil.copytree(tiny, base)
    folder = tmp_path / "run"
    shutil.copytree(original, folder)
    adapter = folder / "adapter"
    out = {"run": folder, "adapter": adapter, "base": base, "above base": base.parent}[where]
    before = {f: listing(f) for f in (folder, base)}
    argv = ["--base", str(base), "--adapter", str(adapter), "--out", str(out), "--overwrite"]
    assert merge.main(argv) == 1
    said = capsys.readouterr().err.strip()
    what = "adapter" if where in ("run", "adapter") else "base model"
    assert said.startswith(f"error: {out}: is or holds the {what} ") and "\n" not in said, said
    assert {f: listing(f) for f in (folder, base)} == before
    with pytest.raises(ValueError, match=f"is or holds the {what}"):
        merge_adapter(str(base), str(adapter), str(out), overwrite=True)


@pytest.fixture(scope="module")
def other_base(tmp_path_factory):
    """A tiny model of the same shape as the tests' one, with other weights."""
    return make_tiny_model(tmp_path_factory.mktemp("other") / "base", seed=7)


def test_relay_merge_refuses_an_adapter_trained_on_other_weights(run, other_base, tmp_path, capsys):
    """adapter_config.json names the base it was trained on (an absolute folder): merged onto another
    model of the same shape, it merged silently; now refused in one line, and nothing is written.
    The base it names merges as before."""
    base, folder = run
    adapter = str(folder / "adapter")
    out = tmp_path / "merged"
    assert merge.main(["--base", str(other_base), "--adapter", adapter, "--out", str(out)]) == 1
    said = capsys.readouterr().err.strip()
    assert said.startswith(f"error: --adapter {adapter} was trained on other weights than --base {other_base}")
    assert "base_model_name_or_path" in said and "\n" not in said and not out.exists()
    assert adapter_base_problem(str(base), adapter) is None
    assert merge.main(["--base", str(base), "--adapter", adapter, "--out", str(out)]) == 0


def test_the_runs_manifest_is_the_record_where_the_adapter_names_a_relative_path(run, other_base, tmp_path):
    """A stage started with a relative model.path records that path in adapter_config.json, which
    says nothing once the working directory is unknown: it is not compared. The run's merged/
    manifest, written after the adapter and naming it, records the parent's weights hash: that is."""
    base, original = run
    folder = tmp_path / "run"
    shutil.copytree(original, folder)
    adapter = folder / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "outputs/pt/merged"}))
    assert adapter_base_problem(str(other_base), str(adapter)) is None
    merge_adapter(str(base), str(adapter), str(folder / "merged"))
    problem = adapter_base_problem(str(other_base), str(adapter))
    assert problem and f"{folder / 'merged' / 'manifest.json'} parent_hash" in problem
    assert adapter_base_problem(str(base), str(adapter)) is None
    later = (folder / "merged" / "manifest.json").stat().st_mtime + 10
    os.utime(adapter / "adapter_model.safetensors", (later, later))  # an adapter newer than the manifest: another run's
    assert adapter_base_problem(str(other_base), str(adapter)) is None


@pytest.fixture(scope="module")
def bf16_base(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("bf16") / "base", seed=3)
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def dtypes(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {fh.get_slice(key).get_dtype() for key in fh.keys()}


def test_a_bf16_base_merges_into_bf16(bf16_base, tmp_path):
    """A LoRA merge onto a bf16 base was saved in fp32 (twice the base's size; full fine-tuning
    saves its own dtype). The merge is computed in fp32, then rounded: the saved tensors are peft's
    own fp32 merge of the same base and adapter, cast to bf16, and the manifest says so."""
    adapter = make_adapter(bf16_base, tmp_path / "adapter")
    out = merge_adapter(str(bf16_base), adapter, str(tmp_path / "merged"))
    assert dtypes(bf16_base) == dtypes(out) == {"BF16"}
    assert (out / "model.safetensors").stat().st_size <= 1.01 * (bf16_base / "model.safetensors").stat().st_size
    base = AutoModelForCausalLM.from_pretrained(bf16_base, dtype=torch.float32)
    expected = PeftModel.from_pretrained(base, adapter).merge_and_unload().to(torch.bfloat16).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)
    check = json.loads((out / "manifest.json").read_text())["merge_check"]
    assert check["dtype"] == "bfloat16" and check["merge_max_abs_diff"] < check["tolerance"] == 1e-3
    assert check["reload_max_abs_diff"] is not None


def test_an_fp32_base_stays_fp32(run, tmp_path):
    base, folder = run
    out = merge_adapter(str(base), str(folder / "adapter"), str(tmp_path / "merged"))
    assert (
        dtypes(out) == {"F32"} and json.loads((out / "manifest.json").read_text())["merge_check"]["dtype"] == "float32"
    )


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("untied") / "base", tie_word_embeddings=False)


def test_lora_on_a_tied_module_is_one_line_per_target(tiny_model_dir, untied):
    """The tiny model ties lm_head to model.embed_tokens (as SmolLM2, the embedded model, does)."""
    both = LoraConfig(target_modules=["q_proj", "lm_head", "model.embed_tokens"])
    problems = tied_lora_problems(tiny_model_dir, both)
    assert len(problems) == 2
    assert problems[0].startswith("lora.target_modules: lm_head shares its weight with model.embed_tokens ")
    assert "(tie_word_embeddings: true in " in problems[0] and "lora.modules_to_save: [lm_head]" in problems[0]
    assert problems[1].startswith("lora.target_modules: model.embed_tokens shares its weight with lm_head ")
    assert tied_lora_problems(tiny_model_dir, LoraConfig(target_modules=["embed_tokens"]))[0].startswith(
        "lora.target_modules: embed_tokens (model.embed_tokens) shares its weight with lm_head "
    )
    assert tied_lora_problems(tiny_model_dir, LoraConfig()) == []  # all-linear leaves the head out
    assert tied_lora_problems(tiny_model_dir, LoraConfig(target_modules=["q_proj"], modules_to_save=["lm_head"])) == []
    assert tied_lora_problems(untied, both) == []
    assert tied_lora_problems(tiny_model_dir, both, kind="reward") == []  # a classifier's head is its own
    assert len(tied_lora_problems("embedded", LoraConfig(target_modules=["lm_head"]))) == 1


def test_what_the_tied_check_refuses_is_what_the_merge_cannot_do(tiny_model_dir, tmp_path):
    """The outside evidence for the refusal: LoRA trained on the tied head fails the merge's own
    check (its update lands in the matrix the embedding shares), while the way the line points to,
    the head trained in full (modules_to_save), merges into a model with its own head."""
    adapter = make_adapter(tiny_model_dir, tmp_path / "lora-head", target_modules=["q_proj", "lm_head"])
    with pytest.raises(MergeError, match="outputs moved by"):
        merge_adapter(str(tiny_model_dir), adapter, str(tmp_path / "merged-lora"))
    adapter = make_adapter(
        tiny_model_dir, tmp_path / "saved-head", target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    out = merge_adapter(str(tiny_model_dir), adapter, str(tmp_path / "merged-saved"))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_stage_refuses_lora_on_a_tied_module_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """It trained to the end, then the merge stopped in a MergeError traceback with no merged/."""
    from test_pt_sft import sft_args, write_sft

    from pipeline.config import ConfigError, load_config
    from pipeline.modeling import models
    from stages.sft import SFTConfig, SFTStage

    train, valid = write_sft(tmp_path / "data", big=4, small=4)
    argv = sft_args(tiny_model_dir, train, valid, tmp_path / "out", "--lora.target_modules", "[q_proj,lm_head]")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError) as err:
        SFTStage(load_config(SFTConfig, argv)).validate()
    assert [p for p in err.value.problems if p.startswith("lora.target_modules: lm_head shares its weight")]
    SFTStage(load_config(SFTConfig, argv[:-1] + ["[q_proj]"])).validate()
