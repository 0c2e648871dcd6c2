"""What data_formats.sources reads from a file before any format sees it: strings that are not
valid Unicode, JSON Lines in a .json file, Parquet that cannot be read, the nulls Arrow fills in,
and the files of a folder that are not data. Each is checked against what a peer reads (the
tokenizer, `datasets`' own loaders) or against the same records read as JSON Lines."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from data_formats import sources, validate


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """`datasets` caches what it loads under HF_DATASETS_CACHE: keep it in the test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))


def _chat(user: str, assistant: str, **assistant_keys) -> dict:
    turns = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant, **assistant_keys}]
    return {"messages": turns}


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _read_as(conversation) -> tuple:
    """What a conversation says, without where it came from."""
    return conversation.turns, conversation.meta, conversation.tools, conversation.standard


def _problems(entries, kind: str) -> list[str]:
    return [str(p) for p in validate.read_and_parse([str(e) for e in entries], kind)[1]]


# --- unpaired surrogates ---------------------------------------------------------------------------


def test_the_tokenizer_refuses_a_lone_surrogate():
    """Why the reader must refuse it: the string json decodes from `"\\ud800"` is no text a fast
    tokenizer accepts (a TypeError mid-run, after validation said OK)."""
    from tinymodels import tiny_tokenizer_source
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_source())
    assert json.loads('"c\\ud800 x"') == "c\ud800 x"
    with pytest.raises(TypeError):
        tokenizer("c\ud800 x")
    assert tokenizer(json.loads('"\\ud83d\\ude00"'))["input_ids"]  # a paired escape is one character


def test_a_lone_surrogate_is_one_problem_naming_the_field(tmp_path):
    # json.dumps writes a lone surrogate as the escape `\ud800`, as the files that carry one do
    sft = _write_jsonl(tmp_path / "sft.jsonl", [_chat("hi", "c\ud800 x"), _chat("hi \U0001f600", "there")])
    assert '"c\\ud800 x"' in sft.read_text()
    assert _problems([sft], "sft") == [
        f"{sft}:1: messages[1].content holds an unpaired surrogate \\ud800 (not valid Unicode)"
    ]
    pt = _write_jsonl(tmp_path / "pt.jsonl", [{"text": "good"}, {"text": "abc \udc00 tail"}])
    assert _problems([pt], "pt") == [f"{pt}:2: text holds an unpaired surrogate \\udc00 (not valid Unicode)"]
    rm = tmp_path / "rm.json"  # a .json array's element, and a key
    rm.write_text(json.dumps([{"prompt": "q", "chosen": "a", "rejected": "b", "meta": {"k\ud83d": 1}}], indent=1))
    assert _problems([rm], "rm") == [f"{rm}:2: a key of meta holds an unpaired surrogate \\ud83d (not valid Unicode)"]


# --- JSON Lines in a .json file --------------------------------------------------------------------


def test_json_lines_in_a_json_file_reads_as_datasets_reads_it(tmp_path):
    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(3)]
    path = _write_jsonl(tmp_path / "belle.json", rows)
    expected = datasets.load_dataset("json", data_files=str(path), split="train").to_list()
    assert expected == rows
    raws = list(sources.read_entry(str(path)))
    assert [(r.line, r.record, r.error) for r in raws] == [(i + 1, row, None) for i, row in enumerate(expected)]
    good, problems = validate.read_and_parse([str(path)], "sft")
    assert len(good) == 3 and problems == []


def test_json_lines_in_a_json_file_reports_each_bad_line(tmp_path):
    path = tmp_path / "mixed.json"
    path.write_text('{"text": "one"}\n{"text": "two"\n\n{"text": "four"}\n', encoding="utf-8")
    assert [(r.line, r.error and r.error.split(":")[0]) for r in sources.read_entry(str(path))] == [
        (1, None),
        (2, "invalid JSON"),
        (3, "blank line"),
        (4, None),
    ]


def test_one_json_value_is_still_one_record(tmp_path):
    """A pretty-printed record, or a one-line record, is one value, not JSON Lines."""
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps({"text": "a"}, indent=2) + "\n", encoding="utf-8")
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"text": "b"}) + "\n\n", encoding="utf-8")
    assert [r.record for r in sources.read_entry(str(pretty))] == [{"text": "a"}]
    assert [r.record for r in sources.read_entry(str(one))] == [{"text": "b"}]
    two = tmp_path / "two.json"  # two values on one line stay what json.loads says
    two.write_text('{"text": "a"} {"text": "b"}\n', encoding="utf-8")
    assert [r.error for r in sources.read_entry(str(two))] == ["invalid JSON: Extra data (column 15)"]


# --- Parquet -------------------------------------------------------------------------------------------


def test_unreadable_parquet_is_one_problem_beside_the_others(tmp_path):
    good = tmp_path / "good.parquet"
    datasets.Dataset.from_list([{"text": "x" * 200 + str(i)} for i in range(400)]).to_parquet(str(good))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_text("not parquet")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    bad_jsonl = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, "not an object"])
    problems = _problems([bad_jsonl, garbage, cut, good], "pt")
    assert problems[0].startswith(f"{bad_jsonl}:2: ")
    not_parquet = "cannot read parquet: Parquet magic bytes not found in footer."
    assert problems[1].startswith(f"{garbage}:0: {not_parquet}")
    assert problems[2].startswith(f"{cut}:0: {not_parquet}")
    assert len(problems) == 3


def test_parquet_with_a_corrupt_page_is_one_problem(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"text": ["x" * 200 + str(i) for i in range(2000)]}), path, row_group_size=500)
    data = bytearray(path.read_bytes())
    start = len(data) // 4  # inside the first row groups' pages: the footer still reads
    data[start : start + 200] = b"\xab" * 200
    path.write_bytes(bytes(data))
    (raw,) = sources.read_entry(str(path))
    assert (raw.line, raw.record) == (0, None)
    assert raw.error.startswith("cannot read parquet: ")


def test_parquet_nulls_are_the_keys_a_jsonl_record_lacks(tmp_path):
    """The same records as JSONL and as the Parquet `datasets` writes of them read alike: Arrow's
    null in a column a record lacks (alpaca's `input`, a message's `weight`) is no given value."""
    alpaca = [{"instruction": "q1", "input": "ctx", "output": "a"}, {"instruction": "q2", "output": "b"}]
    weighted = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "draft", "weight": 0},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "final", "weight": 1},
        ]
    }
    messages = [weighted, _chat("q", "a")]
    for name, records in (("alpaca", alpaca), ("messages", messages)):
        jsonl = _write_jsonl(tmp_path / f"{name}.jsonl", records)
        parquet = tmp_path / f"{name}.parquet"
        datasets.Dataset.from_list(records).to_parquet(str(parquet))
        rows = datasets.load_dataset("parquet", data_files=str(parquet), split="train").to_list()
        assert rows != records  # what Arrow gives: every key in every row and message, null where absent
        assert [r.record for r in sources.read_entry(str(parquet))] == records
        from_jsonl, problems = validate.read_and_parse([str(jsonl)], "sft")
        from_parquet, parquet_problems = validate.read_and_parse([str(parquet)], "sft")
        assert problems == parquet_problems == []
        assert [_read_as(p.value) for p in from_parquet] == [_read_as(p.value) for p in from_jsonl]


def test_a_null_inside_a_list_stays(tmp_path):
    path = tmp_path / "scores.parquet"
    row = {"prompt": "q", "scores": [1.0, None], "meta": {"a": None, "b": "x"}}
    datasets.Dataset.from_list([row]).to_parquet(str(path))
    expected = {"prompt": "q", "scores": [1.0, None], "meta": {"b": "x"}}
    assert [r.record for r in sources.read_entry(str(path))] == [expected]


# --- a folder's files that are not data -------------------------------------------------------------


def test_a_folders_readme_and_licence_are_passed_over_whatever_their_suffix(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    _write_jsonl(folder / "train.jsonl", [{"text": "a document"}])
    (folder / "part.txt").write_text("another document")
    not_data = ("README.txt", "LICENSE.txt", "readme.md", "Licence", "COPYING.txt", "sub/NOTICE.txt", "README.zh.jsonl")
    for name in not_data:
        (folder / name).write_text("Licensed under the Apache License, Version 2.0")
    files, dataset = sources.expand_entry(str(folder))
    assert dataset is None and [f.relative_to(folder).as_posix() for f in files] == ["part.txt", "train.jsonl"]
    good, problems = validate.read_and_parse([str(folder)], "pt")
    assert problems == [] and sorted(p.value for p in good) == ["a document", "another document"]
    sft_folder = tmp_path / "sft"
    sft_folder.mkdir()
    _write_jsonl(sft_folder / "train.jsonl", [_chat("hi", "there")])
    (sft_folder / "README.txt").write_text("How this data was made.")
    assert _problems([sft_folder], "sft") == []
    # named directly (or by a glob), a file is read: the rule is only what a folder holds
    assert [r.record for r in sources.read_entry(str(folder / "README.txt"))] == [
        {"text": "Licensed under the Apache License, Version 2.0"}
    ]
