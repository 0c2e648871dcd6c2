"""Preflight (pipeline/modeling/preflight.py): every wrong model path a newcomer gives is one line
naming the key, the path and the fix, reported by the stage before any tokenizer or model loads."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import transformers

from pipeline.engine.stage_main import main
from pipeline.modeling import preflight
from stages.ppo import PPOStage
from stages.reward import RMStage
from stages.sft import SFTStage


@pytest.fixture
def no_loading(monkeypatch):
    """Any tokenizer or model load fails the test: preflight must refuse before loading."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before preflight refused the path")

    for name in ("AutoTokenizer", "AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refuse)
    import pipeline.modeling.models as models

    for name in ("AutoTokenizer", "AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(models, name), "from_pretrained", refuse)


def problems_of(stage_class, argv, tmp_path, capsys) -> list[str]:
    """Run the stage's main; return the problem lines it printed (it must exit 2)."""
    code = main(stage_class, ["--output_dir", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    return [line.removeprefix("  - ") for line in err.splitlines() if line.startswith("  - ")]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_folder(tmp_path, capsys, no_loading):
    missing = tmp_path / "models" / "Qwen2.5-0.5B-Instruct"
    assert problems_of(SFTStage, ["--model.path", str(missing)], tmp_path, capsys) == [
        f"model.path: {missing}: no such folder"
    ]


def test_hub_id_not_cached_offline(tmp_path, capsys, no_loading, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    assert problems_of(SFTStage, ["--model.path", "Qwen/Qwen2.5-0.5B-Instruct"], tmp_path, capsys) == [
        "model.path: 'Qwen/Qwen2.5-0.5B-Instruct': no such folder, and no hub model of that name in the local cache "
        "(HF_HUB_OFFLINE=1); give a local folder, or download it first: hf download Qwen/Qwen2.5-0.5B-Instruct"
    ]


def test_hub_id_in_cache_is_fine(monkeypatch):
    monkeypatch.setattr("huggingface_hub.try_to_load_from_cache", lambda *a, **k: "/cache/config.json")
    assert preflight.model_problems("Qwen/Qwen2.5-0.5B-Instruct") == []


def test_folder_that_is_no_model(tmp_path, capsys, no_loading):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "README.md").write_text("hello")
    assert problems_of(SFTStage, ["--model.path", str(folder)], tmp_path, capsys) == [
        f"model.path: {folder} has no config.json: not a Hugging Face model folder"
    ]


def test_adapter_folder_points_at_merged(tmp_path, capsys, no_loading, tiny_model_dir):
    run = tmp_path / "sft"
    adapter = run / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base", "peft_type": "LORA"}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    copy_model(tiny_model_dir, run / "merged")
    assert problems_of(SFTStage, ["--model.path", str(adapter)], tmp_path, capsys) == [
        f"model.path: {adapter} is a LoRA adapter, not a model; use {run / 'merged'}"
    ]
    shutil.rmtree(run / "merged")  # no merged/ sibling: say how to merge
    (line,) = problems_of(SFTStage, ["--model.path", str(adapter)], tmp_path, capsys)
    assert line == (
        f"model.path: {adapter} is a LoRA adapter, not a model; merge it first "
        f"(relay merge --base base --adapter {adapter} --out {run / 'merged'}) and use the merged folder"
    )


def test_pickled_weights_and_no_tokenizer(tmp_path, capsys, no_loading, tiny_model_dir):
    folder = copy_model(tiny_model_dir, tmp_path / "model")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    for name in ("tokenizer.json", "vocab.json"):
        (folder / name).unlink(missing_ok=True)
    lines = problems_of(SFTStage, ["--model.path", str(folder)], tmp_path, capsys)
    assert lines[0].startswith(
        f"model.path: {folder} has only pickled weights (pytorch_model.bin), and unpickling can run code"
    )
    assert lines[0].endswith("or set model.allow_pickle: true to load them with torch.load(weights_only=True)")
    assert lines[1].startswith(f"model.path: {folder} has no tokenizer (none of tokenizer.json")
    assert len(lines) == 2
    assert preflight.model_problems(str(folder), allow_pickle=True) == [
        lines[1]
    ]  # opted in: only the tokenizer is missing
    (folder / "pytorch_model.bin").unlink()
    assert preflight.model_problems(str(folder))[0] == f"model.path: {folder} has no weights (no *.safetensors)"


def test_reward_model_where_a_language_model_is_needed(tmp_path, capsys, no_loading, tiny_reward_dir):
    assert problems_of(SFTStage, ["--model.path", str(tiny_reward_dir)], tmp_path, capsys) == [
        f"model.path: {tiny_reward_dir} is a reward model (a sequence classifier); this needs a causal language "
        "model, e.g. the SFT stage's merged/"
    ]


def test_reward_stage_accepts_either_kind(tiny_model_dir, tiny_reward_dir):
    for folder in (tiny_model_dir, tiny_reward_dir):
        assert preflight.model_problems(str(folder), need="any") == []
    assert RMStage.model_kind == "reward"


def test_manifest_model_kind_decides(tmp_path, tiny_model_dir):
    folder = copy_model(tiny_model_dir, tmp_path / "m")
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "model_kind": "reward"}))
    assert preflight.model_kind_of(folder) == "reward"


def test_ppo_requires_a_trained_reward_model(tmp_path, capsys, no_loading, tiny_model_dir):
    lines = problems_of(PPOStage, ["--model.path", str(tiny_model_dir)], tmp_path, capsys)
    assert lines == [
        "reward_model.path: PPO needs a trained reward model: give the RM stage's merged/ folder "
        "(or set reward_model.allow_untrained: true to smoke-test with a random reward head)"
    ]


def test_ppo_reward_model_must_be_a_reward_model(tmp_path, capsys, no_loading, tiny_model_dir):
    lines = problems_of(
        PPOStage, ["--model.path", str(tiny_model_dir), "--reward_model.path", str(tiny_model_dir)], tmp_path, capsys
    )
    assert lines == [
        f"reward_model.path: {tiny_model_dir} is a causal language model, not a reward model; give the RM "
        "stage's merged/ (a sequence classifier)"
    ]


def test_ppo_untrained_reward_model_when_asked(tiny_model_dir):
    from pipeline.config import load_config
    from stages.ppo import PPOConfig

    cfg = load_config(
        PPOConfig,
        [
            "--model.path",
            str(tiny_model_dir),
            "--reward_model.path",
            "embedded",
            "--reward_model.allow_untrained",
            "true",
        ],
    )
    assert not [p for p in PPOStage(cfg).problems() if "allow_untrained" in p]


def test_from_sft_on_a_fresh_root_says_pt_has_not_run(tmp_path, capsys):
    """`relay pipeline --from sft` before PT ever ran: one line naming the stage, not "no manifest"."""
    from pipeline.tools.driver import run_command

    config = Path(__file__).resolve().parents[1] / "configs" / "pipeline.yaml"
    code = run_command(
        ["prepare", str(config), "sft", "--from", "sft", "--output_root", str(tmp_path / "fresh")], sys.stdout
    )
    err = capsys.readouterr().err
    assert code != 0
    pt_merged = (tmp_path / "fresh" / "pt" / "merged").resolve()
    assert f"pt has not run: {pt_merged} does not exist yet; run the pipeline from pt (--from pt)" in err
    assert "not produced by Relay" not in err


def test_pipeline_summary_names_both_stage_times(tmp_path):
    """summary.json's two PT times are two named figures with a note, not one name for two clocks."""
    from pipeline.tools.chain_config import load_pipeline
    from pipeline.tools.driver import pipeline_summary

    root = tmp_path / "run"
    config = Path(__file__).resolve().parents[1] / "configs" / "pipeline.yaml"
    cfg, _ = load_pipeline(str(config), ["--output_root", str(root), "--gold.data", "null"])
    (root / "pt").mkdir(parents=True)
    (root / "pt" / "summary.json").write_text(json.dumps({"train_loss_first": 3.0, "wall_seconds": 10.0}))
    (root / "timings.json").write_text(json.dumps({"pt": {"started": 100.0, "finished": 125.0}}))
    summary = pipeline_summary(cfg)
    assert summary["pt_wall_seconds"] == 25.0 and summary["pt_train_seconds"] == 10.0
    assert summary["stages"]["pt"]["wall_seconds"] == 10.0
    assert "<stage>_wall_seconds: the driver's clock" in summary["timing"]
