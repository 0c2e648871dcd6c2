"""Streamed PT data (data.streaming): the same rows as the in-memory corpus, an exact resume of
the stream, bad records reported before training, and a PT run that resumes bit for bit."""

import json
import logging
import shutil

import pytest
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from transformers import AutoTokenizer

from data_formats.pt_data import build_pt_data
from data_formats.sources import DataError
from data_formats.streaming import PackedTextStream
from pipeline.config import ConfigError, load_config
from stages.pretrain import PTConfig, PTData, PTStage

SEQ = 16


@pytest.fixture()
def corpus(tmp_path):
    """Two files (JSONL and plain text) with documents shorter and longer than a row."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " + "alpha beta " * (i % 7 + 1)}) + "\n" for i in range(12))
    )
    (folder / "b.txt").write_text("".join(f"plain line {i} " + "gamma " * (3 * i) + "\n" for i in range(6)))
    return folder


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def take(stream, n):
    return [stream.next_row() for _ in range(n)]


def test_stream_gives_the_in_memory_rows_then_starts_over(corpus, tok):
    rows = build_pt_data(PTData(train=[str(corpus)], eval=[]), tok, SEQ, "train")
    assert len(rows) > 8 and any(len(r["lengths"]) > 1 for r in rows)  # documents share and straddle rows
    stream = PackedTextStream([str(corpus)], tok, SEQ)
    assert take(stream, len(rows)) == rows
    assert take(stream, 2) == rows[:2] and stream.epoch == 1  # the next epoch, same order


def test_stream_state_resumes_exactly_through_json(corpus, tok):
    stream = PackedTextStream([str(corpus)], tok, SEQ)
    take(stream, 5)
    state = json.loads(json.dumps(stream.state_dict()))
    want = take(stream, 30)  # crosses the end of the corpus into the next epoch
    resumed = PackedTextStream([str(corpus)], tok, SEQ)
    resumed.load_state_dict(state)
    assert take(resumed, 30) == want
    fresh = PackedTextStream([str(corpus)], tok, SEQ)
    assert take(fresh, 30) != want  # negative control: without the state the rows differ


def pt_args(model, data, out, *extra):
    return [
        "--model.path",
        str(model),
        "--data.train",
        f"[{data}]",
        "--data.eval",
        "[]",
        "--data.streaming",
        "true",
        "--output_dir",
        str(out),
        "--train.seq_length",
        str(SEQ),
        "--train.batch_size",
        "2",
        "--train.grad_accum",
        "2",
        "--train.learning_rate",
        "1e-2",
        "--train.eval_steps",
        "0",
        "--train.max_steps",
        "6",
        "--checkpoint.save_interval",
        "1000h",
        *extra,
    ]


def test_bad_records_are_reported_together_before_training(tiny_model_dir, corpus, tmp_path, caplog):
    (corpus / "c.jsonl").write_text(
        json.dumps({"text": "fine"}) + "\n{broken\n" + json.dumps({"txt": "no text field"}) + "\n"
    )
    with pytest.raises(ConfigError) as err:
        PTStage(load_config(PTConfig, pt_args(tiny_model_dir, corpus, tmp_path / "o"))).validate()
    assert "c.jsonl:2:" in str(err.value) and "c.jsonl:3:" in str(err.value)
    carve = pt_args(tiny_model_dir, corpus, tmp_path / "o", "--data.eval_fraction", "0.1", "--data.on_error", "skip")
    with pytest.raises(ConfigError, match="data.eval_fraction: carving an eval split reads the whole corpus"):
        PTStage(load_config(PTConfig, carve)).validate()
    prepared = PTStage(
        load_config(PTConfig, pt_args(tiny_model_dir, corpus, tmp_path / "o", "--data.on_error", "skip"))
    )
    prepared.validate()
    clean = shutil.copytree(corpus, tmp_path / "clean")
    (clean / "c.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    caplog.clear()
    rows = take(prepared.stream, 20)
    assert prepared.stream.epoch >= 1  # the corpus read twice over, its two bad records said once, above
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert rows == take(
        PackedTextStream([str(clean)], prepared.tokenizer, SEQ), 20
    )  # exactly the two bad records dropped
    (clean / "c.jsonl").unlink()
    assert rows != take(
        PackedTextStream([str(clean)], prepared.tokenizer, SEQ), 20
    )  # the good record of c.jsonl is kept
    with pytest.raises(DataError, match="c.jsonl:2:"):  # strict mode meeting a bad record mid-stream
        take(PackedTextStream([str(corpus)], prepared.tokenizer, SEQ), 40)


def test_a_streamed_file_with_no_good_record_is_refused_as_in_memory(tiny_model_dir, corpus, tmp_path):
    """data.on_error skip skips records, not whole files: streamed, a file of bad records passed the
    check and was left out (or, every file bad, the run failed after the model loaded, in a
    traceback); a weighted entry of such a file yielded nothing. Refused as the in-memory corpus is.
    And a .txt file is a document whatever data.text_field names (it failed as 'missing field')."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "all_bad.jsonl").write_text(json.dumps({"txt": "a"}) + "\n" + json.dumps({"text": 1}) + "\n")
    for streaming in ("true", "false"):
        argv = pt_args(tiny_model_dir, corpus, tmp_path / "o", "--data.on_error", "skip", "--data.streaming", streaming)
        argv[argv.index("--data.train") + 1] = f"[{corpus},{bad}]"
        for extra in ([], ["--data.weights", "[0.5, 0.5]"]):
            with pytest.raises(ConfigError) as err:
                PTStage(load_config(PTConfig, argv + extra)).validate()
            assert any("all_bad.jsonl:0: every record of this file is bad" in p for p in err.value.problems), (
                streaming,
                err.value.problems,
            )
    (corpus / "a.jsonl").write_text(json.dumps({"content": "a document in another field"}) + "\n")
    for streaming in ("true", "false"):
        argv = pt_args(tiny_model_dir, corpus, tmp_path / "o", "--data.text_field", "content")
        PTStage(load_config(PTConfig, argv + ["--data.streaming", streaming])).validate()  # b.txt is read too


def test_streamed_pt_run_resumes_bit_for_bit(tiny_model_dir, corpus, tmp_path, monkeypatch):
    full = run_stage(PTStage, pt_args(tiny_model_dir, corpus, tmp_path / "full"))
    monkeypatch.setenv("RELAY_STOP_AFTER_STEP", "3")
    cut = run_stage(PTStage, pt_args(tiny_model_dir, corpus, tmp_path / "cut"))
    assert cut.step == 3 and not (tmp_path / "cut" / "merged").exists()
    monkeypatch.delenv("RELAY_STOP_AFTER_STEP")
    resumed = run_stage(PTStage, pt_args(tiny_model_dir, corpus, tmp_path / "cut"))
    assert [r["step"] for r in resumed.history.steps] == list(range(1, 7))
    for want, got in zip(full.history.steps[3:], resumed.history.steps[3:]):
        assert (got["train/loss"], got["train/grad_norm"]) == (want["train/loss"], want["train/grad_norm"])
    assert full.history.steps[3]["train/loss"] != full.history.steps[0]["train/loss"]
    assert resumed.stream.state_dict() == full.stream.state_dict()
    assert (tmp_path / "cut" / "merged" / "manifest.json").is_file()


def test_two_processes_stream_the_same_global_batches(tiny_model_dir, corpus, tmp_path):
    """Each rank reads the stream and keeps its share: 2 ranks x batch 2 give the 1 x batch 4 curve."""
    from test_distributed import torchrun

    one = run_stage(
        PTStage, pt_args(tiny_model_dir, corpus, tmp_path / "one", "--train.batch_size", "4", "--lora.dropout", "0")
    )
    torchrun(pt_args(tiny_model_dir, corpus, tmp_path / "two", "--lora.dropout", "0"), tmp_path, stage="pretrain.py")
    trainer = json.loads((tmp_path / "two" / "checkpoints" / "step-0000006" / "trainer.json").read_text())
    two = [r["train/loss"] for r in trainer["history"]["steps"]]
    assert two == pytest.approx([r["train/loss"] for r in one.history.steps], rel=1e-5)
    assert two[-1] != two[0]
