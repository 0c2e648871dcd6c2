"""Input files (issue 12, point 5): every stage reports data problems as `FILE:LINE: reason` with no
traceback, accepts UTF-8 with a byte-order mark and CRLF line ends, bounds the work spent on an
over-long record, packs PT documents in linear time, and says a repeated problem once per file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from data_formats import readers, sources, validate
from data_formats.pt_data import DocumentPacker, build_pt_data, chunk_documents
from data_formats.sources import DataError, Problem
from pipeline.config import ConfigError, DataConfig, load_config

STAGES = ("pt", "sft", "rm", "ppo")


from test_pt_sft import fresh_accelerate_state  # noqa: E402,F401 (autouse fixture: a fresh Accelerator, one thread)


def record(stage: str, i: int) -> dict:
    """One good record of the kind `stage` reads."""
    if stage == "pt":
        return {"text": f"Document number {i} is about the colour blue."}
    if stage == "rm":
        return {"prompt": f"Question {i}?", "chosen": f"A good answer {i}.", "rejected": f"bad {i}"}
    if stage == "ppo":
        return {"prompt": f"Question number {i}?"}
    return {
        "messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    }


def stage_class(stage: str):
    from stages import ppo, pretrain, reward, sft

    return {"pt": pretrain.PTStage, "sft": sft.SFTStage, "rm": reward.RMStage, "ppo": ppo.PPOStage}[stage]


def argv(stage: str, data: Path, out: Path, model: Path, reward_model: Path, *extra: str) -> list[str]:
    args = [
        "--model.path",
        str(model),
        "--data.train",
        f"[{data}]",
        "--data.eval",
        "[]",
        "--output_dir",
        str(out),
        "--train.seq_length",
        "64",
        "--train.batch_size",
        "2",
        "--train.max_steps",
        "1",
        "--train.eval_steps",
        "0",
        "--tracking.trackers",
        "[]",
        *extra,
    ]
    if stage == "ppo":
        args += ["--reward_model.path", str(reward_model), "--generation.max_new_tokens", "8"]
    return args


def validated(stage: str, data: Path, tmp_path: Path, tiny_model_dir, tiny_reward_dir, *extra: str):
    """The stage after `validate()`: config checked, tokenizer loaded, data built; no model loaded."""
    cls = stage_class(stage)
    stage_obj = cls(
        load_config(cls.config_class, argv(stage, data, tmp_path / "out", tiny_model_dir, tiny_reward_dir, *extra))
    )
    stage_obj.validate()
    return stage_obj


def run_main(stage: str, data: Path, tmp_path: Path, tiny_model_dir, tiny_reward_dir, *extra: str) -> tuple[int, str]:
    """Run the stage's command line in process; (exit status, stderr). An escaping exception fails
    the test with its traceback (what the user would have seen)."""
    from pipeline.engine.stage_main import main

    cls = stage_class(stage)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(cls, argv(stage, data, tmp_path / "out", tiny_model_dir, tiny_reward_dir, *extra))
    return status, err.getvalue()


def write_jsonl(path: Path, records: list, *, bom: bool = False, crlf: bool = False) -> Path:
    end = "\r\n" if crlf else "\n"
    text = "".join(json.dumps(r) + end for r in records)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


def write_json(path: Path, records: list, *, bom: bool = False, crlf: bool = False) -> Path:
    text = json.dumps(records, indent=1)
    if crlf:
        text = text.replace("\n", "\r\n")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


# --- 1. every stage: FILE:LINE: reason, never a traceback ---------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_bad_record_is_one_line_in_every_stage(stage, tmp_path, tiny_model_dir, tiny_reward_dir):
    bad = {
        "pt": {"text": ""},
        "sft": {"messages": []},
        "rm": {"prompt": "q", "chosen": "same", "rejected": "same"},
        "ppo": {"prompt": ""},
    }[stage]
    data = write_jsonl(tmp_path / "data.jsonl", [record(stage, 0), bad, record(stage, 1), record(stage, 2)])
    status, err = run_main(stage, data, tmp_path, tiny_model_dir, tiny_reward_dir)
    assert status == 2 and "Traceback" not in err
    lines = [line.strip() for line in err.splitlines() if str(data) in line]
    assert len(lines) == 1 and lines[0].startswith(f"{data}:2: "), err


@pytest.mark.parametrize("case", ["all records skipped", "empty file", "wrong path"])
def test_ppo_data_errors_are_listed_problems(case, tmp_path, tiny_model_dir, tiny_reward_dir):
    """PPO used to crash with a traceback after loading its models when no prompt was left."""
    data = tmp_path / "prompts.jsonl"
    extra: tuple[str, ...] = ("--data.on_error", "skip")
    if case == "all records skipped":
        write_jsonl(data, [{"prompt": ""}, {"prompt": "   "}])
        expected = "data.train: 0 usable prompt(s) cannot fill one rollout batch of 2 x 1 rank(s)"
    elif case == "empty file":
        data.write_text("")
        expected = "data.train: 0 usable prompt(s) cannot fill one rollout batch of 2 x 1 rank(s)"
    else:
        data, expected = tmp_path / "missing" / "prompts.jsonl", "names no data file"
    status, err = run_main("ppo", data, tmp_path, tiny_model_dir, tiny_reward_dir, *extra)
    assert status == 2 and "Traceback" not in err and expected in err, err


# --- 2. a byte-order mark and CRLF line ends ----------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_bom_and_crlf_are_accepted_in_every_stage(stage, tmp_path, tiny_model_dir, tiny_reward_dir):
    """The same records as plain LF JSONL, as JSONL and as a JSON array with a BOM and CRLF ends:
    the three files give the same samples, token for token (one stage run reads all three)."""
    records = [record(stage, i) for i in range(6)]
    files = [
        write_jsonl(tmp_path / "plain.jsonl", records),
        write_jsonl(tmp_path / "windows.jsonl", records, bom=True, crlf=True),
        write_json(tmp_path / "windows.json", records, bom=True, crlf=True),
    ]
    stage_obj = validated(stage, Path(f"{files[0]},{files[1]},{files[2]}"), tmp_path, tiny_model_dir, tiny_reward_dir)
    samples = stage_obj.train_samples
    if stage == "pt":  # packed rows: the token stream is the three files' documents, one after another
        stream = [t for row in samples for t in row["input_ids"]]
        third = len(stream) // 3
        assert len(stream) == 3 * third > 0 and stream[:third] == stream[third : 2 * third] == stream[2 * third :]
        return
    strip = [{k: v for k, v in row.items() if k not in ("source", "task_id")} for row in samples]
    assert len(strip) == 3 * len(records)
    assert strip[:6] == strip[6:12] == strip[12:]
    assert [row["source"] for row in samples[6:12]] == [
        f"{files[1]}:{n}" for n in range(1, 7)
    ]  # lines as the user counts them


def test_bom_crlf_txt_document_reads_as_lf(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_bytes(b"\xef\xbb\xbfline one\r\nline two\r\n")
    (raw,) = list(readers.read_file(path, "doc"))
    assert raw.error is None and raw.record == {"text": "line one\nline two\n"}


# --- 3. an over-long record is refused by its size, unread --------------------------------------


def test_overlong_record_is_refused_unparsed_with_its_line(tmp_path, monkeypatch, tiny_model_dir, tiny_reward_dir):
    limit = 4096
    big = json.dumps(
        {"messages": [{"role": "user", "content": "x" * (3 * 2**20)}, {"role": "assistant", "content": "y"}]}
    )
    data = tmp_path / "sft.jsonl"
    data.write_text(
        json.dumps(record("sft", 0)) + "\n" + big + "\n" + "".join(json.dumps(record("sft", i)) + "\n" for i in (1, 2))
    )
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(
        json, "loads", lambda text, *a, **k: parsed.append("x" * limit in text) or real_loads(text, *a, **k)
    )
    with pytest.raises(ConfigError) as err:
        validated("sft", data, tmp_path, tiny_model_dir, tiny_reward_dir, "--data.max_record_bytes", str(limit))
    assert f"{data}:2: record is {len(big):,} bytes, over the limit of {limit:,} (data.max_record_bytes)" in str(
        err.value
    )
    assert parsed and not any(parsed)  # the big line was never handed to the JSON parser
    stage = validated(
        "sft",
        data,
        tmp_path,
        tiny_model_dir,
        tiny_reward_dir,
        "--data.max_record_bytes",
        str(limit),
        "--data.on_error",
        "skip",
    )
    assert [s["source"] for s in stage.train_samples] and all(
        not s["source"].endswith(":2") for s in stage.train_samples
    )
    assert len(stage.train_samples) == 3


def test_overlong_record_in_json_txt_and_stream(tmp_path):
    limit = 1000
    array = write_json(tmp_path / "a.json", [{"text": "short"}, {"text": "z" * 5000}, {"text": "also short"}])
    raws = list(readers.read_file(array, "a", max_bytes=limit))
    assert [r.error is None for r in raws] == [True, False, True]
    assert raws[1].line == 5 and raws[1].error.startswith("record is 5,017 bytes, over the limit of 1,000")  # indent=1
    txt = tmp_path / "book.txt"
    txt.write_text("w" * 2000)
    (raw,) = list(readers.read_file(txt, "book", max_bytes=limit))
    assert (raw.line, raw.error) == (1, readers.too_long(2000, limit))
    assert DataConfig().max_record_bytes == readers.MAX_RECORD_BYTES == 8 * 2**20  # one default, 8 MiB
    from data_formats.streaming import stream_problems

    lines = tmp_path / "c.jsonl"
    write_jsonl(lines, [{"text": "fine"}, {"text": "q" * 3000}, {"text": "fine too"}], crlf=True)
    (problem,) = stream_problems([str(lines)], max_record_bytes=limit)
    assert (problem.line, problem.reason) == (2, readers.too_long(len(json.dumps({"text": "q" * 3000})), limit))


# --- 4. PT packing in linear time ---------------------------------------------------------------


def packed_before_the_fix(docs, eos_id, seq_length):
    """The packer as it was (commit 684f124): the reference rows, quadratic in a document's length."""
    rows, current, lengths = [], [], []

    def row():
        labels = list(current)
        start = 0
        for n in lengths:
            labels[start] = -100
            start += n
        return {"input_ids": list(current), "labels": labels, "lengths": list(lengths), "task_ids": [0] * len(current)}

    for doc in docs:
        tokens = list(doc) + [eos_id]
        while tokens:
            room = seq_length - len(current)
            piece, tokens = tokens[:room], tokens[room:]
            current += piece
            lengths.append(len(piece))
            if len(current) == seq_length:
                rows.append(row())
                current, lengths = [], []
    return rows + ([row()] if current else [])


class CountingList(list):
    """A document that counts the tokens copied out of it by slicing."""

    copied = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.copied += len(got)
        return got


def test_packing_matches_the_old_rows_and_copies_each_token_once():
    generator = torch.Generator().manual_seed(0)
    lengths = [0, 1, 5, 7, 8, 9, 40, 3, 100, 15, 16, 17, 1]
    docs = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in lengths]
    for seq in (2, 8, 16, 33):  # the old packer also made rows that train nothing (every label -100)
        trained = [row for row in packed_before_the_fix(docs, 2, seq) if set(row["labels"]) != {-100}]
        assert chunk_documents(docs, 2, seq) == trained, seq
    for n in (10_000, 40_000):  # the old packer copied ~n^2 / (2 * seq) tokens: 6.25M and 100M here
        CountingList.copied = 0
        rows = DocumentPacker(2, 8).add(CountingList(range(n)))
        assert len(rows) == (n + 1) // 8
        assert CountingList.copied == n  # every token once, into its row: linear


def test_streamed_pt_rows_equal_in_memory_rows(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from data_formats.streaming import PackedTextStream
    from pipeline.config import TextDataConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["short one.", "a much longer document " * 40, "x", "another document, of middling length " * 5]
    corpus = write_jsonl(tmp_path / "pt.jsonl", [{"text": t} for t in texts], bom=True, crlf=True)
    rows = build_pt_data(TextDataConfig(train=[str(corpus)]), tokenizer, 16, "train")
    stream = PackedTextStream([str(corpus)], tokenizer, 16)
    streamed = [stream.next_row() for _ in range(len(rows) - 1)]  # the last in-memory row is the short flush
    assert streamed == rows[:-1]


# --- 5. a repeated problem is one line per file -------------------------------------------------


def test_wrong_kind_of_data_is_one_line_with_a_hint(tmp_path, tiny_model_dir, tiny_reward_dir):
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [record("rm", i) for i in range(200)])
    status, err = run_main("sft", prefs, tmp_path, tiny_model_dir, tiny_reward_dir)
    lines = [line.strip() for line in err.splitlines() if str(prefs) in line]
    assert status == 2 and lines == [
        f"{prefs}:1: 200 records: looks like preference data (chosen/rejected), not SFT conversations "
        "(chatml, messages, sharegpt, alpaca, pair, firefly, "
        "prompt_completion): use the RM stage (stages/reward.py) (lines 1-200)"
    ]


def test_unsupported_suffix_is_named_once(tmp_path, tiny_model_dir, tiny_reward_dir):
    table = tmp_path / "data.csv"
    table.write_text("prompt,response\n" + "".join(f"q{i},a{i}\n" for i in range(50)))
    status, err = run_main("sft", table, tmp_path, tiny_model_dir, tiny_reward_dir)
    lines = [line.strip() for line in err.splitlines() if str(table) in line]
    assert status == 2 and lines == [
        f"{table}:0: .csv files are not supported; use .jsonl, "
        ".json, .parquet, .txt (JSON Lines, a JSON array, Parquet, plain text)"
    ]


def test_a_folders_data_files_it_cannot_read_are_each_one_problem_as_when_named(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    good = write_jsonl(folder / "a.jsonl", [record("sft", 0)])
    unreadable = [folder / name for name in ("b.JSONL", "c.jsonl.gz", "d.Json", "e.csv", "f.csv.zst", "g.parquet.zst")]
    for path in unreadable:
        path.write_bytes(good.read_bytes())
    for name in ("README.md", ".DS_Store", "make_data.py"):  # not data: passed over
        (folder / name).write_text("notes\n")
    assert sources.expand_entry(str(folder)) == ([good, *unreadable], None)
    named = {}
    for path in unreadable:
        assert validate.main(["--kind", "sft", str(path)]) == 1
        named[path] = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{path}:0: ")]
    assert validate.main(["--kind", "sft", str(folder)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if ":0: " in line] == [line for path in unreadable for line in named[path]]
    assert named[folder / "b.JSONL"] == [
        f"{folder / 'b.JSONL'}:0: .JSONL files are not supported (suffixes are case-sensitive): rename it to .jsonl"
    ]
    assert named[folder / "c.jsonl.gz"] == [
        f"{folder / 'c.jsonl.gz'}:0: compressed .jsonl.gz files are not supported: decompress it to a .jsonl file"
    ]
    assert out[-1] == "1 record(s) passed the record checks; 6 problem(s) in 6 file(s)"


def test_summarize_groups_by_file_and_reason():
    from data_formats.sources import summarize

    problems = [Problem("a.jsonl", n, "field 'text' is empty") for n in (1, 2, 3, 7, 9, 10)]
    problems += [Problem("a.jsonl", 4, "blank line"), Problem("b.jsonl", 2, "field 'text' is empty")]
    assert summarize(problems) == [
        "a.jsonl:1: 6 records: field 'text' is empty (lines 1-3, 7, 9-10)",
        "a.jsonl:4: blank line",
        "b.jsonl:2: field 'text' is empty",
    ]
    assert len(DataError(problems).problems) == 8  # every record is still listed for on_error=skip


def test_skip_logs_one_line_per_file_and_reason(tmp_path, caplog):
    data = write_jsonl(tmp_path / "pt.jsonl", [{"text": ""}] * 30 + [{"text": "fine"}])
    with caplog.at_level(logging.INFO, logger="data_formats.validate"):
        good, problems = validate.read_and_parse([str(data)], "pt")
        validate.apply_policy(problems, "skip")
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")]
    assert len(good) == 1 and len(problems) == 30
    assert skipped == [f"skipped {data}:1: 30 records: field 'text' is empty (lines 1-30)"]


def test_validate_names_each_files_format(tmp_path, capsys):
    chat = write_jsonl(tmp_path / "chat.jsonl", [record("sft", i) for i in range(3)])
    prefs = write_jsonl(tmp_path / "prefs.jsonl", [record("rm", i) for i in range(4)])
    assert validate.main([str(chat), str(prefs)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{chat}: format 'messages' (detected), 3 good record(s), 0 problem(s)" in out
    assert f"{prefs}: no usable format, 0 good record(s), 4 problem(s)" in out
    assert validate.main(["--kind", "rm", str(prefs)]) == 0
    assert f"{prefs}: format 'preference' (detected), 4 good record(s), 0 problem(s)" in capsys.readouterr().out
