"""Resume checks what it resumes (issue 12, point 3): a checkpoint records its stage and the
identity of its run (pipeline.engine.identity); another stage's folder, another LoRA shape, a
changed config or changed data are refused before any model loads, with every difference listed;
`checkpoint.resume_changed: true` accepts config changes, applies them (a new learning rate
really trains at the new rate) and records them in the manifest; changes that do not alter what
the steps compute (max_steps, the split of the global batch) resume without a word but a log."""

from __future__ import annotations

import json

import pytest
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state, run_sft, sft_args, write_sft  # noqa: F401 (autouse fixture)

from pipeline.config import ConfigError
from pipeline.engine.schedule import lr_at


@pytest.fixture
def sft_data(tmp_path):
    return write_sft(tmp_path / "data", 12, 4)


def finished_sft(tiny_model_dir, sft_data, out, *extra):
    train, valid = sft_data
    return run_sft(
        sft_args(tiny_model_dir, train, valid, out, "--train.max_steps", "4", "--train.eval_steps", "0", *extra)
    )


def no_model_loads(monkeypatch):
    """Make any model load fail loudly: the refusals must come before anything heavy."""
    import pipeline.modeling.models as models

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", refuse)


def test_a_finished_folder_with_new_data_lr_and_seed_is_refused_with_every_difference(
    tiny_model_dir, sft_data, tmp_path, monkeypatch
):
    out = tmp_path / "sft"
    finished_sft(tiny_model_dir, sft_data, out)
    manifest_before = (out / "merged" / "manifest.json").read_text()
    other = write_sft(tmp_path / "other", 14, 4)
    no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as err:
        run_sft(
            sft_args(
                tiny_model_dir,
                other[0],
                other[1],
                out,
                "--train.max_steps",
                "4",
                "--train.eval_steps",
                "0",
                "--train.learning_rate",
                "1e-3",
                "--train.seed",
                "7",
            )
        )
    text = str(err.value)
    assert "the training data files changed" in text
    assert "train.learning_rate: 0.005 -> 0.001" in text and "train.seed: 42 -> 7" in text
    assert "data.train:" in text  # the path list itself changed too
    assert "checkpoint.resume_changed: true" in text
    assert (out / "merged" / "manifest.json").read_text() == manifest_before  # nothing rewritten


@pytest.mark.parametrize("stage_name", ["pt", "rm"])
def test_another_stages_folder_is_refused(stage_name, tiny_model_dir, sft_data, tmp_path, monkeypatch):
    out = tmp_path / "sft"
    finished_sft(tiny_model_dir, sft_data, out)
    data = tmp_path / "d.jsonl"
    if stage_name == "pt":
        from stages.pretrain import PTStage as cls

        data.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(8)))
    else:
        from stages.reward import RMStage as cls

        data.write_text(
            "".join(
                json.dumps({"question": f"q{i}", "response_chosen": "good", "response_rejected": "bad"}) + "\n"
                for i in range(8)
            )
        )
    no_model_loads(monkeypatch)
    with pytest.raises(ConfigError) as err:
        run_stage(
            cls,
            [
                "--model.path",
                str(tiny_model_dir),
                "--data.train",
                f"[{data}]",
                "--output_dir",
                str(out),
                "--train.seq_length",
                "32",
                "--train.batch_size",
                "2",
                "--tracking.trackers",
                "[]",
            ],
        )
    (line,) = err.value.problems
    assert f"it was written by the 'sft' stage, this is '{stage_name}'" in line
    assert "checkpoint.resume: false" in line


def test_a_changed_lora_shape_is_refused_in_one_line(tiny_model_dir, sft_data, tmp_path, monkeypatch):
    out = tmp_path / "sft"
    finished_sft(tiny_model_dir, sft_data, out)
    no_model_loads(monkeypatch)
    with pytest.raises(ConfigError, match=r"cannot resume it: lora\.r: 16 -> 8") as err:
        finished_sft(tiny_model_dir, sft_data, out, "--lora.r", "8", "--checkpoint.resume_changed", "true")
    assert "size mismatch" not in str(err.value)


def test_an_edited_training_file_is_refused(tiny_model_dir, sft_data, tmp_path, monkeypatch):
    out = tmp_path / "sft"
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    finished_sft(tiny_model_dir, sft_data, out)
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    big = sft_data[0] / "big.jsonl"
    big.write_text(big.read_text().replace("ANSWER", "RESULT"))
    with pytest.raises(ConfigError, match="the training data files changed"):
        finished_sft(tiny_model_dir, sft_data, out)


def test_a_new_learning_rate_accepted_on_resume_really_trains_at_it(tiny_model_dir, sft_data, tmp_path, monkeypatch):
    out = tmp_path / "sft"
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    first = finished_sft(tiny_model_dir, sft_data, out)
    assert first.step == 2

    def first_lrs_at(step):
        return lr_at(step - 1, first.cfg.train.max_steps, first.cfg.train)

    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    with pytest.raises(ConfigError, match="train.learning_rate: 0.005 -> 0.02"):
        finished_sft(tiny_model_dir, sft_data, out, "--train.learning_rate", "2e-2")
    resumed = finished_sft(
        tiny_model_dir, sft_data, out, "--train.learning_rate", "2e-2", "--checkpoint.resume_changed", "true"
    )
    cfg = resumed.cfg.train
    assert cfg.learning_rate == 2e-2
    for record in resumed.history.steps[2:]:
        assert record["train/lr"] == pytest.approx(lr_at(record["step"] - 1, cfg.max_steps, cfg), rel=1e-12)
        assert record["train/lr"] == pytest.approx(4 * first_lrs_at(record["step"]), rel=1e-9)  # 2e-2 / 5e-3
    manifest = json.loads((out / "merged" / "manifest.json").read_text())
    assert manifest["resume_changes"] == [{"step": 2, "changes": ["train.learning_rate: 0.005 -> 0.02"]}]


def test_a_new_split_of_the_same_global_batch_reads_the_same_samples(tiny_model_dir, sft_data, tmp_path, monkeypatch):
    """2 x 2 -> 4 x 1: allowed (the global batch is the same); the resumed steps draw exactly the
    samples an unbroken 2 x 2 run draws, and their losses agree to float tolerance."""
    train, valid = sft_data
    steps = [
        "--train.max_steps",
        "5",
        "--train.eval_steps",
        "0",
        "--lora.dropout",
        "0",
    ]  # dropout draws follow the batch shape
    unbroken = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "a", *steps))
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "2")
    run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "b", *steps))
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    resumed = run_sft(
        sft_args(
            tiny_model_dir, train, valid, tmp_path / "b", *steps, "--train.batch_size", "4", "--train.grad_accum", "1"
        )
    )
    flat = [sorted(i for group in step for i in group) for step in resumed.batch_ids]
    assert flat == [sorted(i for group in step for i in group) for step in unbroken.batch_ids[2:]]
    for want, got in zip(unbroken.history.steps[2:], resumed.history.steps[2:]):
        assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-5)
    assert "resume_changes" not in json.loads((tmp_path / "b" / "merged" / "manifest.json").read_text())


def test_more_steps_resume_a_finished_run_without_refusal(tiny_model_dir, sft_data, tmp_path):
    out = tmp_path / "sft"
    finished_sft(tiny_model_dir, sft_data, out)
    longer = run_sft(sft_args(tiny_model_dir, *sft_data, out, "--train.max_steps", "6", "--train.eval_steps", "0"))
    assert [r["step"] for r in longer.history.steps] == list(range(1, 7)) and len(longer.batch_ids) == 2


def test_an_explicit_checkpoint_that_is_not_one_is_a_listed_problem(tiny_model_dir, sft_data, tmp_path, monkeypatch):
    no_model_loads(monkeypatch)
    with pytest.raises(
        ConfigError, match=r"checkpoint.resume: .*nowhere is not a complete checkpoint \(no .complete marker\)"
    ):
        finished_sft(tiny_model_dir, sft_data, tmp_path / "sft", "--checkpoint.resume", str(tmp_path / "nowhere"))
