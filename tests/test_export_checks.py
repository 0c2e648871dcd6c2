"""What `relay export` (pipeline/tools/release.py) refuses and what its model card
(pipeline/tools/model_card.py) claims, and the model-folder checks `relay export`, `relay serve`
and `relay eval` share: --out over the source is refused before anything is deleted; the card
reads the data paths as the training run read them and says when the files changed since; a
reward model's card scores a conversation as Relay reads the reward; a model's own code files ship
with it and `relay serve` says truly why it refuses them; the base model of a chain whose parent
folder is gone; an unfinished run."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import yaml

from pipeline.engine.identity import data_digest
from pipeline.modeling.manifest import write_manifest
from pipeline.tools import evaluate, release, serve
from pipeline.tools.model_card import FINETUNING_READS, default_name, hyper_parameters, manifest_chain, model_card

# ------------------------------------------------------------------------------------------
# --out over the source
# ------------------------------------------------------------------------------------------


@pytest.fixture
def run_folder(tmp_path, tiny_model_dir):
    """tmp/project/run: a run folder with merged/ (a child of the tiny model) and a notes file beside it."""
    run = tmp_path / "project" / "run"
    shutil.copytree(tiny_model_dir, run / "merged")
    write_manifest(run / "merged", stage="sft", parent=str(tiny_model_dir), extra={"summary": {"steps": 1}})
    (tmp_path / "project" / "notes.txt").write_text("keep\n")
    return run


def _snapshot(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(
    "out, where",
    [
        ("project/run", "is the source folder"),
        ("project", "holds the source folder"),
        ("project/run/merged", "is inside the source folder"),
        ("project/run/release", "is inside the source folder"),
    ],
)
def test_export_refuses_an_out_over_its_source_before_deleting_anything(run_folder, tmp_path, out, where):
    """The reviewer's repro: `relay export victim2/run2 --out victim2 --overwrite` deleted the run
    and its neighbours before failing. Every overlap is one line, and nothing changes."""
    before = _snapshot(tmp_path)
    with pytest.raises(release.ExportError, match=f"--out .* {where}.*; give a folder outside it"):
        release.export(str(run_folder), str(tmp_path / out), overwrite=True)
    assert _snapshot(tmp_path) == before


def test_export_cli_refuses_an_out_over_its_source_through_a_relative_path(run_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path / "project")
    assert release.main(["run", "--out", "./run/..", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds the source folder" in err[0]
    assert (run_folder / "merged" / "model.safetensors").is_file() and (tmp_path / "project" / "notes.txt").is_file()


# ------------------------------------------------------------------------------------------
# The card's data section: read as the run read it
# ------------------------------------------------------------------------------------------


@pytest.fixture
def trained_project(tmp_path, tiny_model_dir, monkeypatch):
    """A project folder whose run `outputs/sft` (output_dir relative, as configs/*.yaml have it)
    trained on the folder `data/sft` and the Hub dataset `org/chats`, its manifest's data_digest
    computed as the stage computes it, from the project folder."""
    project = tmp_path / "project"
    (project / "data" / "sft").mkdir(parents=True)
    (project / "data" / "sft" / "a.jsonl").write_text('{"messages": []}\n')
    (project / "data" / "eval.jsonl").write_text('{"messages": []}\n')
    merged = project / "outputs" / "sft" / "merged"
    shutil.copytree(tiny_model_dir, merged)
    train = ["data/sft", "org/chats"]
    monkeypatch.chdir(project)
    digest = data_digest(train)
    config = {
        "output_dir": "outputs/sft",
        "model": {"finetuning": "lora"},
        "data": {"train": train, "eval": ["data/eval.jsonl"]},
    }
    extra = {"model_kind": "causal", "summary": {"steps": 3}, "data_digest": digest}
    write_manifest(
        merged,
        stage="sft",
        parent=str(tiny_model_dir),
        adapter=str(merged.parent / "adapter"),
        config=config,
        extra=extra,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return project


def _meta(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


def test_card_reads_the_data_paths_from_the_folder_the_run_ran_in(trained_project, tmp_path, capfd):
    """Exported from another folder: the local folder `data/sft` is fingerprinted from the
    project (not taken for a Hub dataset, as it was), the real Hub id stays in `datasets:`."""
    out = release.export(str(trained_project / "outputs" / "sft"), str(tmp_path / "release"))
    card = (out / "README.md").read_text()
    sha = release.file_sha256(trained_project / "data" / "sft" / "a.jsonl")
    assert _meta(card)["datasets"] == ["org/chats"]
    assert f"`train: data/sft/a.jsonl`: `{sha}`" in card and "`train: org/chats`: `hub dataset`" in card
    assert "paths relative to the folder the stage ran in" in card and str(trained_project) not in card
    assert "changed since" not in card and "warning" not in capfd.readouterr().err


def test_card_and_a_warning_say_when_the_train_files_changed_after_training(trained_project, tmp_path, capfd):
    (trained_project / "data" / "sft" / "a.jsonl").write_text('{"messages": [], "edited": true}\n')
    out = release.export(str(trained_project / "outputs" / "sft"), str(tmp_path / "release"))
    card = (out / "README.md").read_text()
    assert "the train files changed since the stage trained on them" in card
    assert "datasets" not in _meta(card)  # not claimed from data that is not what it trained on
    err = capfd.readouterr().err
    assert "warning: sft: its train files changed since it trained on them" in err


def test_card_without_the_runs_folder_shows_the_paths_as_written(trained_project, tmp_path, capfd, monkeypatch):
    """output_dir absolute (the run's folder unknown): from a folder where the files are not, the
    entries are shown as written with no hashes and no Hub datasets; from the folder where the
    train files reproduce the manifest's data_digest, they are fingerprinted."""
    merged = trained_project / "outputs" / "sft" / "merged"
    manifest = json.loads((merged / "manifest.json").read_text())
    manifest["config"]["output_dir"] = str(merged.parent)
    (merged / "manifest.json").write_text(json.dumps(manifest))
    card = (release.export(str(merged), str(tmp_path / "r1")) / "README.md").read_text()
    assert "datasets" not in _meta(card) and "  - `train: data/sft`\n" in card and "hub dataset" not in card
    assert "as written in the stage's config" in card
    assert "note: sft: its data paths are relative to the folder it ran in" in capfd.readouterr().err
    monkeypatch.chdir(trained_project)
    card = (release.export(str(merged), str(tmp_path / "r2")) / "README.md").read_text()
    assert _meta(card)["datasets"] == ["org/chats"] and "`train: data/sft/a.jsonl`: `" in card


# ------------------------------------------------------------------------------------------
# Reward models: relay eval refuses them; the card scores as Relay reads the reward
# ------------------------------------------------------------------------------------------


def test_eval_refuses_a_reward_model(tiny_reward_dir, tmp_path):
    with pytest.raises(evaluate.EvalError, match="is a reward model \\(a sequence classifier\\)"):
        evaluate.model_folder(str(tiny_reward_dir))
    run = tmp_path / "rm"
    shutil.copytree(tiny_reward_dir, run / "merged")
    with pytest.raises(evaluate.EvalError, match="is a reward model"):
        evaluate.model_folder(str(run))


@pytest.fixture
def reward_run(tiny_reward_dir, tmp_path):
    run = tmp_path / "rm"
    shutil.copytree(tiny_reward_dir, run / "merged")
    write_manifest(
        run / "merged",
        stage="rm",
        parent=str(tiny_reward_dir),
        adapter=str(run / "adapter"),
        extra={"model_kind": "reward", "summary": {"steps": 2}},
    )
    return run


def test_reward_card_scores_a_conversation_as_relay_reads_the_reward(reward_run, tmp_path):
    """The card's snippet, run on the exported folder, gives the score Relay's RM and PPO read:
    the conversation rendered by data_formats.render.render_scored (up to the end-of-turn token
    that closes the answer) through pipeline.modeling.scoring.sequence_scores."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from data_formats.conversation import Conversation, Turn
    from data_formats.render import make_template, render_scored
    from pipeline.config import PreferenceDataConfig
    from pipeline.modeling.scoring import sequence_scores

    out = release.export(str(reward_run), str(tmp_path / "release"), name="me/rm")
    card = (out / "README.md").read_text()
    assert "relay serve FOLDER" not in card and "AutoModelForCausalLM" not in card
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert "AutoModelForSequenceClassification" in snippet
    scope: dict = {}
    exec(snippet.replace('"me/rm"', repr(str(out))), scope)  # noqa: S102 - the card's own text, on the tiny model

    tok = AutoTokenizer.from_pretrained(out)
    conv = Conversation([Turn(m["role"], m["content"]) for m in scope["messages"]])
    prompt, response = render_scored(conv, tok, make_template(PreferenceDataConfig(), tok))
    ids = torch.tensor([prompt + response])
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        relay = sequence_scores(model, ids, torch.ones_like(ids))[0].item()
    assert scope["ids"]["input_ids"][0].tolist() == prompt + response
    assert scope["reward"] == pytest.approx(relay, abs=1e-6)
    text = tok.apply_chat_template(scope["messages"], tokenize=False)  # uncut: it ends after the end of turn
    with torch.no_grad():
        uncut = model(**tok(text, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
    assert uncut != pytest.approx(relay, abs=1e-4)  # negative control: the cut is what the card adds


def test_gguf_of_a_reward_model_is_refused_naming_the_source(reward_run, tmp_path):
    with pytest.raises(release.ExportError) as err:
        release.export(str(reward_run), str(tmp_path / "release"), gguf_type="f32")
    assert f"--gguf: {reward_run / 'merged'} is a reward model" in str(err.value) and ".partial-" not in str(err.value)
    assert not (tmp_path / "release").exists()


# ------------------------------------------------------------------------------------------
# A model's own code
# ------------------------------------------------------------------------------------------


@pytest.fixture
def custom_code_model(tiny_model_dir, tmp_path):
    """A tiny model whose config.json maps its classes to .py files in the folder (auto_map) under
    a model_type transformers does not know. Importing any of them raises: nothing may run them."""
    folder = tmp_path / "custom"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "relay_test_custom"
    config["auto_map"] = {
        "AutoConfig": "configuration_relay.RelayConfig",
        "AutoModelForCausalLM": "modeling_relay.RelayForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    boom = 'raise RuntimeError("this code ran")\n'
    (folder / "configuration_relay.py").write_text(boom)
    (folder / "modeling_relay.py").write_text("from .layers_relay import Block\n" + boom)
    (folder / "layers_relay.py").write_text(boom)
    (folder / "train_notes.py").write_text(boom)  # the folder's, but no auto_map module needs it
    return folder


def test_export_ships_the_code_files_auto_map_names(custom_code_model, tmp_path):
    out = release.export(str(custom_code_model), str(tmp_path / "release"))
    shipped = {p.name for p in out.iterdir()}
    assert {"configuration_relay.py", "modeling_relay.py", "layers_relay.py"} <= shipped
    assert "train_notes.py" not in shipped
    assert (out / "modeling_relay.py").read_bytes() == (custom_code_model / "modeling_relay.py").read_bytes()
    sums = (out / release.CHECKSUMS).read_text()
    assert "  modeling_relay.py\n" in sums and "  layers_relay.py\n" in sums
    card = (out / "README.md").read_text()
    assert "trust_remote_code=True" in card and "relay serve FOLDER" not in card


def test_export_refuses_a_folder_missing_a_code_file_its_auto_map_names(custom_code_model, tmp_path):
    (custom_code_model / "layers_relay.py").unlink()
    with pytest.raises(release.ExportError, match="its auto_map needs layers_relay.py, which it does not hold"):
        release.export(str(custom_code_model), str(tmp_path / "release"))
    assert not (tmp_path / "release").exists()


def test_serve_says_it_runs_no_model_code(custom_code_model, capsys):
    """It said `set --model.trust_remote_code: true`, which relay serve does not accept."""
    assert serve.main([str(custom_code_model), "--backend", "relay"]) == 2
    err = capsys.readouterr().err
    assert "relay serve runs no code from a model folder" in err and "trust_remote_code: true" not in err


# ------------------------------------------------------------------------------------------
# Card text: the base of an orphaned chain, LoRA's settings; an unfinished run
# ------------------------------------------------------------------------------------------


def test_card_names_the_recorded_parent_when_its_folder_is_gone(tiny_model_dir, tmp_path):
    parent = tmp_path / "parent"
    shutil.copytree(tiny_model_dir, parent)
    merged = tmp_path / "run" / "merged"
    shutil.copytree(tiny_model_dir, merged)
    manifest = write_manifest(
        merged, stage="sft", parent=str(parent), adapter=str(merged.parent / "adapter"), extra={"summary": {"steps": 1}}
    )
    shutil.rmtree(parent)
    chain = manifest_chain(merged)
    assert len(chain) == 1
    card = model_card(chain, default_name(chain, None))
    assert default_name(chain, None) == "parent-sft"
    assert "`merged`" not in card and f"no longer at {parent}" in card
    assert f"(stage `tiny-random`, weights sha256 `{manifest['parent_hash']}`)" in card


@pytest.mark.parametrize("finetuning, shown", [("lora", False), ("qlora", True)])
def test_lora_line_shows_quantisation_only_for_qlora(finetuning, shown):
    config = {
        "model": {"finetuning": finetuning},
        "lora": {"r": 8, "alpha": 16, "quant_type": "nf4", "double_quant": True},
    }
    lora = next(line for line in hyper_parameters(config) if line.startswith("lora:"))
    assert lora.startswith("lora: r=8, alpha=16") and ("quant_type=nf4" in lora) == shown


def test_every_finetuning_mode_says_what_it_reads():
    from pipeline.config.sections import FINETUNING

    assert set(FINETUNING_READS) == set(FINETUNING)


def test_an_unfinished_run_is_named_so_by_export_serve_and_eval(tmp_path):
    run = tmp_path / "stopped"
    (run / "checkpoints" / "step-0000175").mkdir(parents=True)
    (run / "config.yaml").write_text("output_dir: stopped\n")
    said = f"{run} is an unfinished run (it has checkpoints/ but no merged/): rerun the command that started it"
    with pytest.raises(release.ExportError, match=re.escape(said)):
        release.export(str(run), str(tmp_path / "release"))
    assert any(said in p for p in serve.model_folder_problems(str(run)))
    with pytest.raises(evaluate.EvalError, match=re.escape(said)):
        evaluate.model_folder(str(run))


def test_a_distilled_models_card_lists_the_completions_it_trained_on_and_its_teacher(tmp_path):
    """distill with lmbda < 1 trains on data.completions too: its manifest's data_digest covers them
    (data_digest_keys); the card read the train files alone, so it said they had changed and left
    the completions out. It names the teacher (and an RL stage's reward model) it learned from."""
    from pipeline.tools.model_card import stage_data, stage_section

    prompts, completions = tmp_path / "prompts.jsonl", tmp_path / "completions.jsonl"
    prompts.write_text('{"prompt": "q"}\n')
    completions.write_text('{"messages": []}\n')
    manifest = {
        "stage": "distill",
        "config": {"data": {"train": [str(prompts)], "completions": [str(completions)]}},
        "data_digest": data_digest([str(prompts), str(completions)]),
        "data_digest_keys": ["data.train", "data.completions"],
        "teacher": {"path": "/models/teacher", "weights_hash": "ab" * 32},
    }
    found = stage_data(manifest)
    assert not found.stale and [f for f, _ in found.files] == [f"train: {prompts}", f"completions: {completions}"]
    assert f"- teacher it learned from: `/models/teacher` (weights sha256 `{'ab' * 32}`)" in stage_section(
        manifest, found
    )
    completions.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    assert stage_data(manifest).stale
    older = {k: v for k, v in manifest.items() if k != "data_digest_keys"}  # written before the keys were recorded
    older["data_digest"] = data_digest([str(prompts)])
    assert not stage_data(older).stale and [f for f, _ in stage_data(older).files] == [f"train: {prompts}"]
