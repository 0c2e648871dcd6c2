"""What a distillation run is: the teacher folder gets model.path's folder checks before anything
loads; a teacher whose embedding rows differ from the student's is named for what differs; the
teacher's weights and data.completions' files are part of the run's identity (a resume after either
changed is refused) and of the manifest's data digest (the pipeline calls a finished run stale).

Peers: trl 1.16.0 trl/trainer/distillation_trainer.py `DistillationTrainer.__init__` and
trl/experimental/gkd/gkd_trainer.py `GKDTrainer.__init__` refuse a teacher whose
`config.vocab_size` differs from the student's ("requires a shared vocabulary"), whatever the
tokenizer; pipeline/modeling/preflight.py words the folder checks as model.path gets them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from stagerun import run_stage
from test_distill import _args, fresh_state  # noqa: F401

from pipeline.config import ConfigError, load_config
from pipeline.modeling.manifest import read_manifest, weights_hash
from pipeline.tools.chain import stage_argv, stage_status
from pipeline.tools.chain_config import DriverError, PipelineConfig


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> Path:
    """tests/test_distill.py's teacher: wider than the student, the same tokenizer and vocab_size."""
    from tinymodels import make_tiny_model

    folder = tmp_path_factory.mktemp("teacher") / "model"
    return make_tiny_model(folder, seed=7, hidden_size=96, intermediate_size=192, initializer_range=0.2)


def _refusals(student: Path, teacher: Path, tmp: Path, monkeypatch, *extra: str) -> list[str]:
    """The teacher.path lines a distill run on `teacher` stops with, before any model loads."""
    from stages import distill as stage

    monkeypatch.setattr(stage, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    cfg = load_config(stage.DistillConfig, _args(student, teacher, tmp / "data", tmp / "out", *extra))
    with pytest.raises(ConfigError) as err:
        stage.DistillStage(cfg).run()
    return [p for p in err.value.problems if p.startswith("teacher.path")]


def _pickled(source: Path, folder: Path) -> Path:
    """`source` with its weights as pytorch_model.bin only (a pickle-only folder)."""
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "manifest.json"))
    torch.save(load_file(source / "model.safetensors"), folder / "pytorch_model.bin")
    return folder


def _adapter(folder: Path, base: Path) -> Path:
    """A LoRA adapter folder as peft saves one (no config.json, no tokenizer)."""
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base), "r": 4}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("kind", ["reward", "pickled", "adapter"])
def test_a_teacher_folder_gets_the_checks_model_path_gets(
    kind, tiny_model_dir, tiny_reward_dir, teacher_folder, tmp_path, monkeypatch
):
    """A reward model, a pickle-only folder and a LoRA adapter as teacher.path: one line each, in
    preflight's words for the teacher's key, before any model loads (not a reward model loaded as a
    causal LM without its score head, a transformers error after the student loaded, or an adapter
    said not to share a tokenizer)."""
    if kind == "reward":
        lines = _refusals(tiny_model_dir, tiny_reward_dir, tmp_path, monkeypatch)
        assert lines == [
            f"teacher.path: {tiny_reward_dir} is a reward model (a sequence classifier); this needs a causal "
            "language model, e.g. the SFT stage's merged/"
        ]
    elif kind == "pickled":
        lines = _refusals(tiny_model_dir, _pickled(teacher_folder, tmp_path / "pickled"), tmp_path, monkeypatch)
        assert len(lines) == 1 and "has only pickled weights (pytorch_model.bin)" in lines[0], lines
        assert "set teacher.allow_pickle: true" in lines[0]
    else:
        adapter = _adapter(tmp_path / "run" / "adapter", tiny_model_dir)
        lines = _refusals(tiny_model_dir, adapter, tmp_path, monkeypatch)
        assert len(lines) == 1 and lines[0].startswith(f"teacher.path: {adapter} is a LoRA adapter, not a model; "), (
            lines
        )


def test_a_pickled_teacher_passes_with_its_own_allow_pickle(tiny_model_dir, teacher_folder, tmp_path):
    from stages.distill import TeacherConfig, teacher_problems

    pickled = str(_pickled(teacher_folder, tmp_path / "pickled"))
    assert teacher_problems(TeacherConfig(path=pickled, allow_pickle=True), pickled, str(tiny_model_dir)) == []


@pytest.mark.usefixtures("fresh_state")
def test_a_teacher_with_padded_embedding_rows_is_refused_for_what_differs(
    tiny_model_dir, teacher_folder, tmp_path, monkeypatch
):
    """Same tokenizer files, more embedding rows (vocab_size 9842 against 9778, as Qwen2.5-7B pads
    152064 rows against 0.5B's 151936): refused as TRL 1.16 refuses it, in words that say the
    tokenizer is shared and the rows are not. The unpadded teacher passes (control)."""
    from tinymodels import make_tiny_model
    from transformers import AutoTokenizer

    from stages.distill import TeacherConfig, teacher_problems

    tokens = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    padded = make_tiny_model(tmp_path / "padded", seed=7, hidden_size=96, intermediate_size=192, vocab_size=tokens + 64)
    lines = _refusals(tiny_model_dir, padded, tmp_path, monkeypatch)
    assert lines == [
        f"teacher.path: the student {tiny_model_dir} and the teacher {padded} share a tokenizer ({tokens} tokens) "
        f"but not the number of embedding rows (config.json vocab_size: the student has {tokens}, the teacher "
        f"{tokens + 64}; the rows past the tokenizer's are padding): the loss compares the two next-token "
        "distributions row for row, so they need one vocab_size"
    ]
    assert teacher_problems(TeacherConfig(path=str(teacher_folder)), str(teacher_folder), str(tiny_model_dir)) == []


def _stopped_run(student: Path, teacher: Path, tmp: Path, monkeypatch) -> tuple[list[str], Path]:
    """A 2-step run on the dataset's completions (lmbda 0: no sampling) stopped after step 1;
    returns its argv and its completions file."""
    from stages.distill import DistillStage

    argv = _args(student, teacher, tmp / "data", tmp / "out", "--train.max_steps", "2", "--distill.lmbda", "0")
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "1")
    assert run_stage(DistillStage, argv).step == 1
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    return argv, tmp / "data" / "sft.jsonl"


def _resume_refusals(argv: list[str], *extra: str) -> list[str]:
    from stages.distill import DistillStage

    with pytest.raises(ConfigError) as err:
        run_stage(DistillStage, [*argv, *extra])
    return err.value.problems


REFUSED = (
    "checkpoint.resume_changed: true resumes with the new values (recorded in the manifest); "
    "checkpoint.resume: false starts fresh (the old checkpoints are moved aside)"
)


@pytest.mark.usefixtures("fresh_state")
def test_a_resume_after_the_teachers_weights_changed_is_refused(tiny_model_dir, teacher_folder, tmp_path, monkeypatch):
    """New weights at the same teacher.path (the loss's target; the folder's manifest not rewritten)
    are a change of the run, as a changed learning rate is: the resume is refused, naming both hashes."""
    from tinymodels import make_tiny_model

    teacher = tmp_path / "teacher"
    shutil.copytree(teacher_folder, teacher)
    argv, _ = _stopped_run(tiny_model_dir, teacher, tmp_path, monkeypatch)
    before = weights_hash(teacher)
    other = make_tiny_model(tmp_path / "other", seed=8, hidden_size=96, intermediate_size=192)
    shutil.copy(other / "model.safetensors", teacher / "model.safetensors")
    assert read_manifest(teacher)["weights_hash"] == before
    assert _resume_refusals(argv) == [
        f"{tmp_path / 'out' / 'checkpoints' / 'step-0000001'}: changed since this checkpoint: the model at "
        f"teacher.path changed: weights {before} -> weights {weights_hash(teacher)}",
        REFUSED,
    ]


@pytest.mark.usefixtures("fresh_state")
def test_a_resume_after_the_completions_changed_is_refused_then_recorded(
    tiny_model_dir, teacher_folder, tmp_path, monkeypatch
):
    """Edited data.completions (what lmbda < 1 trains on) is refused as edited data.train is;
    checkpoint.resume_changed accepts it and the manifest records it."""
    from stages.distill import DistillStage

    argv, completions = _stopped_run(tiny_model_dir, teacher_folder, tmp_path, monkeypatch)
    completions.write_text(completions.read_text().replace('"content": "2"', '"content": "22"'))
    change = "the training data files changed (their sha256 differs)"
    assert _resume_refusals(argv) == [
        f"{tmp_path / 'out' / 'checkpoints' / 'step-0000001'}: changed since this checkpoint: {change}",
        REFUSED,
    ]
    resumed = run_stage(DistillStage, [*argv, "--checkpoint.resume_changed", "true"])
    assert [r["step"] for r in resumed.history.steps] == [1, 2]
    manifest = read_manifest(tmp_path / "out" / "merged")
    assert manifest["resume_changes"] == [{"step": 1, "changes": [change]}]
    assert manifest["data_digest_keys"] == ["data.train", "data.completions"]


@pytest.mark.usefixtures("fresh_state")
def test_the_pipeline_calls_a_distilled_model_stale_when_its_completions_change(
    tiny_model_dir, teacher_folder, tmp_path
):
    """The real stage's manifest read as the driver reads it: edited data.completions files (what
    the off-policy steps trained on) make the finished output stale; with lmbda 1 they are not
    trained on and not covered."""
    from stages.distill import DistillStage

    prompts, completions = tmp_path / "prompts.jsonl", tmp_path / "sft.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"count to {i}"}) + "\n" for i in range(2)))
    completions.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"add {i}"}, {"role": "assistant", "content": "2"}]})
            + "\n"
            for i in range(2)
        )
    )
    cfg = PipelineConfig(base_model=str(tiny_model_dir), output_root=str(tmp_path / "out"), chain=["distill"])
    cfg.report = False
    cfg.stages.distill.config = {
        "model": {"dtype": "fp32"},
        "lora": {"r": 4, "alpha": 8},
        "teacher": {"path": str(teacher_folder)},
        "data": {"train": [str(prompts)], "eval": [], "completions": [str(completions)]},
        "distill": {"lmbda": 0.0},
        "train": {"max_steps": 1, "batch_size": 2, "seq_length": 64, "eval_steps": 0, "precision": "fp32"},
        "generation": {"max_new_tokens": 4},
        "checkpoint": {"save_interval": "1000h"},
    }
    run_stage(DistillStage, stage_argv(cfg, "distill")[1:])
    assert stage_status(cfg, "distill") == "done"
    completions.write_text(completions.read_text().replace('"content": "2"', '"content": "3"'))
    with pytest.raises(DriverError, match=r"its training data \(data\.train's, data\.completions's files\) changed"):
        stage_status(cfg, "distill")
    manifest = read_manifest(tmp_path / "out" / "distill" / "merged")
    assert manifest["data_digest_keys"] == ["data.train", "data.completions"]
    on_policy = load_config(DistillStage.config_class, ["--teacher.path", str(teacher_folder), "--distill.lmbda", "1"])
    assert DistillStage(on_policy).training_data() == ("data.train",)
