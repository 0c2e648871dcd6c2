"""Weighted source mixing (data.weights, data.mix_stop) and the one line that says why a source
yields nothing."""

import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config


def chat(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft_cfg(model, train: list[Path], out: Path, *extra: str):
    from stages.sft import SFTConfig

    argv = ["--model.path", str(model), "--data.train", "[" + ",".join(map(str, train)) + "]", "--output_dir", str(out),
            "--train.seq_length", "48", "--train.batch_size", "2", "--train.grad_accum", "1", "--train.learning_rate", "5e-3",
            "--train.warmup", "1", "--train.log_steps", "1", "--train.eval_steps", "0", "--checkpoint.save_interval", "1000h",
            *extra]
    return load_config(SFTConfig, argv)


def fill_line(cfg) -> str:
    """The 'cannot fill' line of the problems validation reports."""
    from stages.sft import SFTStage

    with pytest.raises(ConfigError) as err:
        SFTStage(cfg).validate()
    return next(line.strip(" -") for line in str(err.value).splitlines() if "cannot fill" in line)


# ------------------------------------------------------------------------------------------
# Why a split yields nothing, in the one line
# ------------------------------------------------------------------------------------------


def test_a_split_of_only_overlong_records_says_why_in_the_one_line(tiny_model_dir, tmp_path):
    long = write_jsonl(tmp_path / "long.jsonl", [chat("tell me " * 40, f"answer {i} " * 20) for i in range(3)])
    line = fill_line(sft_cfg(tiny_model_dir, [long], tmp_path / "o"))
    assert line.startswith("data.train: 0 sample(s) cannot fill one micro-batch of 2 x 1 rank(s): 3 dropped as longer "
                           "than train.seq_length 48 (the longest ")
    longest = int(line.split("(the longest ")[1].split()[0])
    assert line.endswith(f"; train.seq_length: {longest} keeps them, data.truncation: truncate shortens them to fit")


def test_the_line_names_each_source_when_several_drop(tiny_model_dir, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat("tell me " * 40, "x")])
    b = write_jsonl(tmp_path / "b.jsonl", [chat("say " * 60, "y"), chat("say " * 30, "z")])
    line = fill_line(sft_cfg(tiny_model_dir, [a, b], tmp_path / "o"))
    assert f"{a}: 1 dropped as longer than train.seq_length 48" in line
    assert f"{b}: 2 dropped as longer than train.seq_length 48" in line
