"""PT and SFT stages end to end: exact resume, torn checkpoints, validation, case3 vs none, the
embedded model learning a format, and every shipped YAML loading."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from stagerun import fresh_accelerate, recording, run_stage

from pipeline.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each in-process run builds its own Accelerator (precision may differ between tests).

    Also one intra-op thread: on the shared 2-core machine we measured 2 threads running a
    135M-model step ~13x slower than 1 (threads spin-wait on each other under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fresh_accelerate()
    yield
    fresh_accelerate()
    torch.set_num_threads(threads)


def chat(q, a, task):
    return {"data_name": task, "chat_rounds": [{"role": "human", "content": q}, {"role": "bot", "content": a}]}


def write_sft(folder: Path, big: int, small: int, valid: int = 2) -> tuple[Path, Path]:
    for split, nb, ns in (("train", big, small), ("valid", valid, valid)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        with open(folder / split / "big.jsonl", "w") as f:
            for i in range(nb):
                f.write(json.dumps(chat(f"add {i} and {i + split.__len__()}", f"ANSWER: {2 * i}", "big")) + "\n")
        with open(folder / split / "small.jsonl", "w") as f:
            for i in range(ns):
                f.write(json.dumps(chat(f"colour of item {i}?", f"COLOUR: blue {i} blue", "small")) + "\n")
    return folder / "train", folder / "valid"


def sft_args(model, train, valid, out, *extra):
    return [
        "--model.path",
        str(model),
        "--data.train",
        f"[{train}]",
        "--data.eval",
        f"[{valid}]",
        "--output_dir",
        str(out),
        "--train.seq_length",
        "48",
        "--train.batch_size",
        "2",
        "--train.grad_accum",
        "2",
        "--train.learning_rate",
        "5e-3",
        "--train.warmup",
        "1",
        "--train.log_steps",
        "1",
        "--checkpoint.save_interval",
        "1000h",
        *extra,
    ]


def run_sft(argv):
    from stages.sft import SFTStage

    return run_stage(recording(SFTStage), argv)


def test_sft_resume_is_exact_and_ignores_a_torn_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    train, valid = write_sft(tmp_path / "data", 10, 4)
    common = [
        "--train.max_steps",
        "6",
        "--train.eval_steps",
        "2",
        "--multitask.weighted_loss_mode",
        "coba",
        "--multitask.coba_warmup_steps",
        "2",
        "--multitask.coba_history_length",
        "3",
        "--lora.dropout",
        "0.1",
    ]
    full = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "full", *common))
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "3")
    first = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "cut", *common))
    assert first.step == 3 and not (tmp_path / "cut" / "merged").exists()
    torn = tmp_path / "cut" / "checkpoints" / "step-0000005"
    shutil.copytree(tmp_path / "cut" / "checkpoints" / "step-0000003", torn)
    (torn / ".complete").unlink()
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    second = run_sft(sft_args(tiny_model_dir, train, valid, tmp_path / "cut", *common))
    assert [r["step"] for r in second.history.steps] == list(range(1, 7))
    for want, got in zip(full.history.steps[3:], second.history.steps[3:]):
        assert (got["train/loss"], got["train/lr"], got["train/grad_norm"]) == (
            want["train/loss"],
            want["train/lr"],
            want["train/grad_norm"],
        )
    assert second.batch_ids == full.batch_ids[3:]
    assert second.coba.weights() == full.coba.weights() != [0.5, 0.5]
    assert (tmp_path / "cut" / "merged" / "manifest.json").is_file()
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["train_loss_first"] == full.history.steps[0]["train/loss"]


def test_validate_reports_every_problem_before_loading_a_model(tiny_model_dir, tmp_path):
    from stages.sft import SFTConfig, SFTStage

    train, valid = write_sft(tmp_path / "data", 4, 2)
    cfg = load_config(SFTConfig, sft_args(tiny_model_dir, train, valid, tmp_path / "o"))
    cfg.data.train = [str(train), str(tmp_path / "missing.jsonl")]
    cfg.multitask.weighted_loss_mode = "case9"
    cfg.train.lr_schedule = "zigzag"
    with pytest.raises(ConfigError) as err:
        SFTStage(cfg).validate()
    text = str(err.value)
    assert "missing.jsonl" in text and "case9" in text and "zigzag" in text
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "t.jsonl").write_text(json.dumps(chat("q", "a", "t")) + "\n{not json\n")
    cfg = load_config(SFTConfig, sft_args(tiny_model_dir, bad, valid, tmp_path / "o"))
    with pytest.raises(ConfigError, match=r"t.jsonl:2"):
        SFTStage(cfg).validate()


def test_case3_trains_the_small_task_at_least_as_fast(tiny_model_dir, tmp_path):
    train, valid = write_sft(tmp_path / "data", 14, 2, valid=3)
    small_loss = {}
    for mode in ("none", "case3"):
        run = run_sft(
            sft_args(
                tiny_model_dir,
                train,
                valid,
                tmp_path / mode,
                "--train.max_steps",
                "6",
                "--train.eval_steps",
                "6",
                "--multitask.weighted_loss_mode",
                mode,
                "--lora.dropout",
                "0",
                "--train.lr_schedule",
                "constant",
            )
        )
        first = json.loads((tmp_path / mode / "merged" / "manifest.json").read_text())
        assert first["tasks"] == ["big", "small"]
        small_loss[mode] = run.history.evals[-1]["eval/loss_task/small"]
    # Both runs start from the same weights (LoRA's B is zero), so a lower final loss is a faster fall.
    print("small-task eval loss after 6 steps:", small_loss)
    assert small_loss["case3"] <= small_loss["none"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "case3" / "runs").iterdir())))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/packing_efficiency",
        "eval/loss",
        "eval/ppl",
        "train/task_weight/big",
        "train/task_weight/small",
        "eval/loss_task/small",
    } <= tags


def test_pt_packs_documents_and_merges(tiny_model_dir, tmp_path):
    from stages.pretrain import PTConfig, PTStage

    docs = tmp_path / "pt.jsonl"
    docs.write_text(
        "".join(json.dumps({"text": f"document {i} " + "lorem ipsum " * (i % 5 + 1)}) + "\n" for i in range(40))
    )
    cfg = load_config(
        PTConfig,
        [
            "--model.path",
            str(tiny_model_dir),
            "--data.train",
            f"[{docs}]",
            "--data.eval",
            "[]",
            "--data.eval_fraction",
            "0.2",
            "--output_dir",
            str(tmp_path / "pt"),
            "--train.max_steps",
            "3",
            "--train.seq_length",
            "32",
            "--train.batch_size",
            "2",
            "--train.learning_rate",
            "1e-2",
            "--train.eval_steps",
            "0",
            "--checkpoint.save_interval",
            "1000h",
        ],
    )
    run = run_stage(PTStage, cfg)
    assert len(run.history.steps) == 3 and run.history.evals  # the final evaluation on the carved-off split
    batch = run.collator([run.train_samples[0]])
    # Per-document attention, built on the model's side from the segment ids: no [B, 1, T, T] mask here.
    assert batch["segment_ids"].shape == (1, 32) and "attention_mask" not in batch
    manifest = json.loads((tmp_path / "pt" / "merged" / "manifest.json").read_text())
    assert manifest["stage"] == "pt" and manifest["summary"]["steps"] == 3
    from pipeline.engine.identity import data_digest  # what it trained on: the pipeline's staleness check reads it

    assert manifest["data_digest"] == data_digest(run.cfg.data.train)
    assert (tmp_path / "pt" / "config.yaml").is_file() and any((tmp_path / "pt" / "runs").rglob("events.*"))


@pytest.mark.parametrize("stage,yaml", [("sft", "configs/sft.yaml"), ("pretrain", "configs/pt.yaml")])
def test_shipped_yaml_loads_and_opens_with_its_command(stage, yaml):
    import importlib

    module = importlib.import_module(f"stages.{stage}")
    cls = module.SFTConfig if stage == "sft" else module.PTConfig
    cfg = load_config(cls, ["--config", str(ROOT / yaml)])
    assert cfg.model.path == "embedded"
    assert (ROOT / yaml).read_text().startswith(f"# torchrun --nproc_per_node 1 stages/{stage}.py --config {yaml}")


def test_bf16_autocast_trains_and_merges(tiny_model_dir, tmp_path):
    """train.precision bf16 (autocast) runs a step, keeps the loss finite and falling, and merges.
    On a tiny model: this CPU has no AMX, and bf16 on the real model costs ~30 s a step."""
    train, valid = write_sft(tmp_path / "data", 6, 2)
    run = run_sft(
        sft_args(
            tiny_model_dir,
            train,
            valid,
            tmp_path / "bf16",
            "--train.max_steps",
            "4",
            "--train.eval_steps",
            "0",
            "--train.precision",
            "bf16",
        )
    )
    losses = [r["train/loss"] for r in run.history.steps]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert run.accelerator.mixed_precision == "bf16" and (tmp_path / "bf16" / "merged" / "manifest.json").is_file()


def test_embedded_lora_learns_the_answer_format(embedded_path, tmp_path):
    """The real model, LoRA in fp32 (what the demo uses on CPU): the loss falls and merged/
    answers in the trained format."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "fmt"
    data.mkdir()
    questions = [
        "What is 2 plus 3?",
        "Name a colour.",
        "How many legs has a cat?",
        "What is the capital of France?",
        "Is water wet?",
        "What is 10 minus 4?",
    ]
    answers = ["5", "Red", "Four", "Paris", "Yes", "6"]
    with open(data / "fmt.jsonl", "w") as f:
        for q, a in zip(questions, answers):
            f.write(json.dumps(chat(q, f"ANSWER: {a}", "fmt")) + "\n")
    out = tmp_path / "sft"
    run = run_sft(
        [
            "--data.train",
            f"[{data}]",
            "--data.eval",
            "[]",
            "--output_dir",
            str(out),
            "--train.max_steps",
            "8",
            "--train.seq_length",
            "64",
            "--train.batch_size",
            "3",
            "--train.grad_accum",
            "1",
            "--train.learning_rate",
            "5e-3",
            "--train.warmup",
            "0",
            "--train.precision",
            "fp32",
            "--train.eval_steps",
            "0",
            "--lora.r",
            "8",
            "--lora.dropout",
            "0",
            "--checkpoint.save_interval",
            "1000h",
        ]
    )
    losses = [r["train/loss"] for r in run.history.steps]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3
    tok = AutoTokenizer.from_pretrained(out / "merged")
    model = AutoModelForCausalLM.from_pretrained(out / "merged", torch_dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 7 plus 1?"}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True).startswith("ANSWER:")


def test_nan_loss_stops_the_run_and_keeps_the_last_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    import pipeline.engine.steps as training
    from pipeline.engine.checkpoint import complete_checkpoints

    real = training.weighted_token_losses
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        objective, losses, tasks = real(*args, **kwargs)
        # grad_accum 2: calls 5 and 6 are step 3's micro-batches; the third step gets a NaN.
        poison = float("nan") if calls["n"] == 5 else 1.0
        return objective * poison, losses * poison, tasks

    monkeypatch.setattr(training, "weighted_token_losses", poisoned)
    train, valid = write_sft(tmp_path / "data", 8, 2)
    out = tmp_path / "nan"
    with pytest.raises(training.NonFiniteError, match="step 3"):
        run_sft(
            sft_args(
                tiny_model_dir,
                train,
                valid,
                out,
                "--train.max_steps",
                "5",
                "--train.eval_steps",
                "0",
                "--checkpoint.keep",
                "[{every: 2}]",
            )
        )
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-0000002"]
    assert not (out / "merged").exists()
