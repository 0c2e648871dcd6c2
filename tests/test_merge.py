"""pipeline.modeling.merge: merged == base+adapter, a clean reload, tied embeddings, manifest, atomicity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from forkserver import python_for_tests
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import pipeline.modeling.merge as merge
from pipeline.config import LoraConfig, ModelConfig
from pipeline.modeling.handoff import check_parent_compatible
from pipeline.modeling.manifest import tokenizer_hash, weights_hash
from pipeline.modeling.merge import MergeError, export_full_model, merge_adapter
from pipeline.modeling.models import load_model

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["<|im_start|>user\nHello there<|im_end|>\n", "The merged model must match base plus adapter."]
SCORE = "base_model.model.score.modules_to_save.default.weight"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on the shared, busy 2-core machine two threads thrash (a QLoRA step
    and an embedded-model forward both ran 10-25x slower with 2), and tiny models gain nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _make_adapter(base: Path, out: Path, kind: str, seed: int = 0) -> Path:
    """A LoRA adapter whose B matrices (and reward head) are perturbed, i.e. 'trained'."""
    model = load_model(ModelConfig(path=str(base), finetuning="lora"), LoraConfig(r=4, alpha=8, dropout=0.0), kind=kind)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    model.save_pretrained(out)
    return out


def _batch(folder: Path) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return dict(tokenizer(TEXTS, return_tensors="pt", padding=True))


@torch.no_grad()
def _outputs(model, batch) -> torch.Tensor:
    logits = model.eval()(**batch).logits
    return logits * batch["attention_mask"].unsqueeze(-1) if logits.dim() == 3 else logits


def _auto(kind: str):
    return AutoModelForCausalLM if kind == "causal" else AutoModelForSequenceClassification


def _merged(kind: str, base: Path, root: Path):
    adapter = _make_adapter(base, root / "adapter", kind)
    merged = merge_adapter(str(base), str(adapter), str(root / "merged"), kind=kind, stage="sft", config={"lr": 1e-4})
    return kind, Path(base), adapter, merged


@pytest.fixture(scope="module")
def causal_case(tiny_model_dir, tmp_path_factory):
    """(kind, base, adapter, merged) for a causal LM."""
    return _merged("causal", tiny_model_dir, tmp_path_factory.mktemp("merge-causal"))


@pytest.fixture(scope="module")
def reward_case(tiny_reward_dir, tmp_path_factory):
    """The same for a sequence classifier whose `score` head the adapter trained (changed)."""
    return _merged("reward", tiny_reward_dir, tmp_path_factory.mktemp("merge-reward"))


@pytest.fixture(scope="module")
def causal_as_reward_case(tiny_model_dir, tmp_path_factory):
    """The RM stage's path: a causal LM loaded as a reward model, so its head starts random."""
    return _merged("reward", tiny_model_dir, tmp_path_factory.mktemp("merge-causal-reward"))


@pytest.fixture(params=["causal", "reward", "causal_as_reward"])
def merged_case(request):
    return request.getfixturevalue(f"{request.param}_case")


def test_merged_equals_base_plus_adapter_and_differs_from_base(merged_case):
    kind, base, adapter, merged = merged_case
    batch = _batch(base)
    extra = {"num_labels": 1} if kind == "reward" else {}
    torch.manual_seed(0)
    base_model = _auto(kind).from_pretrained(base, **extra)
    base_out = _outputs(base_model, batch)
    expected = _outputs(PeftModel.from_pretrained(base_model, adapter), batch)
    model, info = _auto(kind).from_pretrained(merged, output_loading_info=True, **extra)
    got = _outputs(model, batch)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert (got - expected).abs().max() < 1e-3
    assert (got - base_out).abs().max() > 1e-2, "negative control: the merge must change the outputs"


def test_tied_embeddings_stay_tied(causal_case):
    _, _, _, merged = causal_case
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in load_file(merged / "model.safetensors")


@pytest.mark.parametrize("case", ["reward_case", "causal_as_reward_case"])
def test_merged_reward_head_is_the_trained_one(case, request):
    _, base, adapter, merged = request.getfixturevalue(case)
    trained = load_file(adapter / "adapter_model.safetensors")
    (key,) = [k for k in trained if "score" in k]
    saved = load_file(merged / "model.safetensors")["score.weight"]
    assert torch.equal(saved, trained[key])
    original = load_file(base / "model.safetensors").get("score.weight")
    assert original is None or (saved - original).abs().max() > 1e-2
    assert json.loads((merged / "config.json").read_text())["pad_token_id"] == 0


def test_manifest_records_parent_adapter_and_hashes(merged_case):
    kind, base, adapter, merged = merged_case
    manifest = json.loads((merged / "manifest.json").read_text())
    assert manifest["stage"] == "sft" and manifest["model_kind"] == kind
    assert manifest["parent_path"] == str(base.resolve())
    assert manifest["parent_hash"] == weights_hash(base) and manifest["weights_hash"] == weights_hash(merged)
    assert manifest["adapter_path"] == str(adapter.resolve())
    assert manifest["tokenizer_hash"] == tokenizer_hash(base)
    assert manifest["chat_template_hash"] and manifest["vocab_size"] == len(AutoTokenizer.from_pretrained(base))
    assert manifest["config"] == {"lr": 1e-4} and "torch" in manifest["versions"] and manifest["created"]
    assert manifest["merge_check"]["reload_max_abs_diff"] < 1e-3
    assert check_parent_compatible(base, merged) == []
    if kind == "causal":
        assert json.loads((merged / "generation_config.json").read_text())["pad_token_id"] == 0


def test_refuses_a_non_empty_folder_then_overwrites(causal_case, tmp_path):
    _, tiny_model_dir, adapter, _ = causal_case
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not empty"):
        merge_adapter(str(tiny_model_dir), str(adapter), str(out))
    assert (out / "keep.txt").read_text() == "precious"
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    merge_adapter(str(tiny_model_dir), str(adapter), str(out), overwrite=True, chat_template=template)
    assert not (out / "keep.txt").exists()
    assert AutoTokenizer.from_pretrained(out).chat_template == template
    problems = check_parent_compatible(tiny_model_dir, out)
    assert len(problems) == 1 and problems[0].startswith("chat template hash: parent")


def test_a_crash_leaves_no_half_written_folder(causal_case, tmp_path, monkeypatch):
    _, tiny_model_dir, adapter, _ = causal_case

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(merge, "write_manifest", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        merge_adapter(str(tiny_model_dir), str(adapter), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_merge_refuses_an_adapter_of_the_other_kind(causal_case, tmp_path):
    _, tiny_model_dir, adapter, _ = causal_case
    with pytest.raises(
        MergeError, match="task_type is CAUSAL_LM, but kind='reward' needs SEQ_CLS; merge it with kind='causal'"
    ):
        merge_adapter(str(tiny_model_dir), str(adapter), str(tmp_path / "out"), kind="reward")


def test_reload_check_catches_a_wrong_model(causal_case):
    _, base, _, merged = causal_case
    tokenizer = AutoTokenizer.from_pretrained(merged)
    batch = merge.probe_batch(tokenizer)
    expected = merge.model_outputs(AutoModelForCausalLM.from_pretrained(merged).eval(), batch)
    assert merge._check_reload(merged, "causal", batch, expected) < 1e-6
    with pytest.raises(MergeError, match="differ from the expected ones"):
        merge._check_reload(base, "causal", batch, expected)


def test_export_full_model_round_trips(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    out = export_full_model(model, tokenizer, str(tmp_path / "full"), parent=str(tiny_model_dir), stage="pt")
    saved = load_file(out / "model.safetensors")
    assert torch.equal(saved["model.layers.0.mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "pt" and manifest["adapter_path"] is None
    assert manifest["parent_hash"] == weights_hash(tiny_model_dir) != manifest["weights_hash"]
    with pytest.raises(FileExistsError):
        export_full_model(model, tokenizer, str(out), parent=str(tiny_model_dir), stage="pt")
    peft_model = load_model(ModelConfig(path=str(tiny_model_dir)), LoraConfig(r=2))
    with pytest.raises(ValueError, match="got a PeftModel"):
        export_full_model(peft_model, tokenizer, str(tmp_path / "x"), parent=str(tiny_model_dir), stage="pt")


def test_check_parent_compatible_reports_an_added_token(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tokenizer.save_pretrained(tmp_path)
    problems = check_parent_compatible(tiny_model_dir, tmp_path)
    assert any(p.startswith("tokenizer hash: parent") for p in problems)
    n = len(tokenizer) - 1
    assert any(f"embeds {n} tokens, the tokenizer in" in p and p.endswith(f"has {n + 1}") for p in problems)


def test_cli_merges_and_refuses_without_overwrite(causal_case, tmp_path):
    _, base, adapter, _ = causal_case
    out = tmp_path / "cli"
    cmd = [
        python_for_tests(),
        "-m",
        "pipeline.modeling.merge",
        "--base",
        str(base),
        "--adapter",
        str(adapter),
        "--out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "manifest.json").read_text())["adapter_path"] == str(adapter.resolve())
    assert merge.main(cmd[3:]) == 1
    shutil.rmtree(out)


def test_embedded_model_merge_is_exact_and_stays_tied(embedded_path, tmp_path):
    """Realism: the real 30-layer SmolLM2 with tied embeddings and its chat template."""
    model = load_model(
        ModelConfig(path="embedded"), LoraConfig(r=2, alpha=4, dropout=0.0, target_modules=["q_proj", "v_proj"])
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path / "adapter")
    batch = merge.probe_batch(AutoTokenizer.from_pretrained(embedded_path))
    with torch.no_grad(), model.disable_adapter():
        base_out = merge.model_outputs(model.eval(), batch)
    del model
    out = merge_adapter("embedded", str(tmp_path / "adapter"), str(tmp_path / "merged"), stage="sft")
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    assert (merge.model_outputs(merged, batch) - base_out).abs().max() > 1e-2
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["merge_check"]["merge_max_abs_diff"] < 1e-3 and manifest["merge_check"]["reload_max_abs_diff"] < 1e-3
    )
    assert manifest["parent_hash"] == weights_hash(embedded_path)
    assert check_parent_compatible(embedded_path, out) == []


def test_a_stage_merges_with_its_own_tokenizer_and_writes_what_a_reload_writes(tiny_model_dir, tmp_path, monkeypatch):
    """A LoRA stage hands its tokenizer (the one it saved beside the adapter) to the merge instead
    of the merge reading it back: no tokenizer load in the export, and merged/'s tokenizer files and
    weights are byte for byte those of `merge_adapter` reading the adapter folder's tokenizer (the
    `relay merge` path)."""
    import filecmp

    from test_pt_sft import run_sft, sft_args, write_sft

    from pipeline.modeling import merge

    train, valid = write_sft(tmp_path / "data", 4, 2)
    loads = []
    original = merge._load_tokenizer_for_merge
    monkeypatch.setattr(merge, "_load_tokenizer_for_merge", lambda *a, **k: loads.append(a) or original(*a, **k))
    stage = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "out", "--train.max_steps", "1"))
    assert loads == []
    out = tmp_path / "out"
    again = merge_adapter(
        str(tiny_model_dir),
        str(out / "adapter"),
        str(tmp_path / "again"),
        kind="causal",
        stage="sft",
        chat_template=stage.chat_template,
    )
    assert len(loads) == 1
    names = sorted(p.name for p in (out / "merged").iterdir() if p.name != "manifest.json")
    assert names == sorted(p.name for p in again.iterdir() if p.name != "manifest.json")
    assert "tokenizer.json" in names and "model.safetensors" in names
    _, mismatch, errors = filecmp.cmpfiles(out / "merged", again, names, shallow=False)
    assert mismatch == [] and errors == []


def test_relay_merge_of_a_stages_adapter_keeps_the_chat_template_it_trained_on(tiny_model_dir, tmp_path):
    """A run on role markers (or a tool layout) trains on a chat template of Relay's; merged/ gets it,
    and so does the tokenizer saved beside the adapter, which `relay merge` reads: it held the
    base's, so a merge of the adapter rendered prompts another way than the run's merged/."""
    from test_pt_sft import run_sft, sft_args, write_sft
    from transformers import AutoTokenizer

    train, valid = write_sft(tmp_path / "data", 4, 2)
    out = tmp_path / "out"
    stage = run_sft(
        sft_args(tiny_model_dir, train, valid, out, "--train.max_steps", "1", "--data.template", "role_markers")
    )
    assert stage.chat_template is not None
    again = merge_adapter(str(tiny_model_dir), str(out / "adapter"), str(tmp_path / "again"), kind="causal")
    trained = AutoTokenizer.from_pretrained(out / "merged").chat_template
    assert trained == stage.chat_template != AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    assert AutoTokenizer.from_pretrained(again).chat_template == trained
