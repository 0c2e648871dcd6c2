"""Every malformed record in tests/data/bad/ is reported with its file and line; the validate CLI's
exit codes; strict refuses, skip drops exactly the bad records."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from data_formats import validate
from data_formats.datasets import build_sft_data
from data_formats.render import make_template
from data_formats.sources import DataError
from pipeline.config import ChatDataConfig

DATA = Path(__file__).parent / "data"
BAD = DATA / "bad"
SFT_BAD = str(BAD / "sft_bad.jsonl")
EXPECTED = {
    ("sft_bad.jsonl", 2): "invalid JSON",
    ("sft_bad.jsonl", 3): "missing field 'chat_rounds'",
    ("sft_bad.jsonl", 4): "unknown role 'robot'",
    ("sft_bad.jsonl", 5): "empty content",
    ("sft_bad.jsonl", 6): "content must be a string",
    ("sft_bad.jsonl", 7): "must start with a user turn",
    ("sft_bad.jsonl", 8): "two user turns in a row",
    ("sft_bad.jsonl", 9): "system turn must come first",
    ("sft_bad.jsonl", 10): "blank line",
    ("sft_bad.jsonl", 11): "last turn must be the assistant's",
    ("sft_bad.jsonl", 12): "has no turns",
    ("sft_bad.jsonl", 13): "no user turn",
    ("sft_bad.jsonl", 14): "must be a JSON object",
    ("empty.jsonl", 0): "empty file",
    ("undecodable.jsonl", 2): "undecodable bytes",
    ("array_bad.json", 3): "missing field 'output'",
    ("array_bad.json", 4): "field 'instruction' is empty",
}


def _found(problems):
    return {(Path(p.file).name, p.line): p.reason for p in problems}


def test_every_bad_line_reported_with_file_and_line():
    files = [str(BAD / n) for n in ("sft_bad.jsonl", "empty.jsonl", "undecodable.jsonl", "array_bad.json")]
    good, problems = validate.read_and_parse(files, "sft")
    found = _found(problems)
    assert set(found) == set(EXPECTED)
    for key, reason in EXPECTED.items():
        assert reason in found[key], (key, found[key])
    assert sorted((Path(r.file).name, r.line) for r in good) == [
        ("array_bad.json", 2),
        ("sft_bad.jsonl", 1),
        ("sft_bad.jsonl", 15),
        ("undecodable.jsonl", 1),
    ]


def test_preference_problems():
    good, problems = validate.read_and_parse([str(BAD / "prefs_bad.jsonl")], "rm")
    assert _found(problems) == {
        ("prefs_bad.jsonl", 2): "chosen and rejected are identical",
        ("prefs_bad.jsonl", 3): "missing field 'response_rejected'",
    }
    assert [r.line for r in good] == [1, 4]


def test_wrong_kind_is_reported():
    _, problems = validate.read_and_parse([str(BAD / "prefs_bad.jsonl")], "sft")
    reason = _found(problems)[("prefs_bad.jsonl", 1)]
    assert "not SFT conversations" in reason and "use the RM stage" in reason


def test_a_format_that_does_not_read_the_kind_is_refused_not_ignored(capsys):
    """A preference stage's reader takes only preference pairs: `data.format: alpaca` (or --format)
    for RM data was read as pairs all the same, and said so ("format 'alpaca' (given)"); a format
    that reads the kind is taken."""
    pairs = str(BAD / "prefs_bad.jsonl")
    with pytest.raises(ValueError, match="format 'alpaca' .* does not read RM preference pairs: use auto or one of"):
        validate.read_and_parse([pairs], "rm", fmt="alpaca")
    with pytest.raises(ValueError, match="format 'text' .* does not read SFT conversations"):
        validate.read_and_parse([SFT_BAD], "sft", fmt="text")
    with pytest.raises(SystemExit):
        validate.main(["--kind", "rm", "--format", "alpaca", pairs])
    assert "format 'alpaca' (data.format, --format) does not read RM preference pairs" in capsys.readouterr().err
    good, _ = validate.read_and_parse([pairs], "rm", fmt="preference")
    assert [r.line for r in good] == [1, 4]


def test_cli_exit_codes(capsys):
    assert validate.main([SFT_BAD]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{SFT_BAD}:2: invalid JSON: Expecting ',' delimiter (column 60)"
    assert len(out) == 15 and out[-1].startswith(
        "2 record(s) passed"
    )  # 13 problems, the file's format line, the counts
    assert out[-2] == f"{SFT_BAD}: format 'chatml' (detected), 2 good record(s), 13 problem(s)"
    assert validate.main([str(DATA / "good")]) == 0
    assert capsys.readouterr().out.strip().endswith("0 problem(s) in 0 file(s)")
    assert validate.main(["--kind", "rm", str(BAD / "prefs_bad.jsonl")]) == 1
    assert validate.main([str(BAD / "no_such_file.jsonl")]) == 1
    assert "no_such_file.jsonl:0: no such file" in capsys.readouterr().out


def test_cli_reports_overlong(capsys):
    good = str(DATA / "good" / "chatml.jsonl")
    assert validate.main(["--seq-length", "40", "--template", "role_markers", good]) == 1
    assert capsys.readouterr().out.splitlines()[0] == f"{good}:1: overlong: 55 tokens > seq_length 40"
    assert validate.main(["--seq-length", "55", "--template", "role_markers", good]) == 0


def test_strict_refuses_and_skip_drops_exactly_bad(tiny_model_dir, caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = ChatDataConfig(train=[SFT_BAD], template="role_markers")
    template = make_template(cfg, tok)
    with pytest.raises(DataError) as err:
        build_sft_data(cfg, tok, template, 512, "train")
    assert len(err.value.problems) == 13
    assert f"{SFT_BAD}:9: turn 1: system turn must come first" in str(err.value)
    cfg.on_error = "skip"
    with caplog.at_level(logging.WARNING):
        data = build_sft_data(cfg, tok, template, 512, "train")
    assert [s["source"] for s in data.samples] == [f"{SFT_BAD}:1", f"{SFT_BAD}:15"]
    assert "skipping 13 bad record(s)" in caplog.text


PAIR = '{"prompt": "a", "chosen": "b", "rejected": "c"}'
PAIR2 = '{"prompt": "a2", "chosen": "b", "rejected": "c"}'


@pytest.mark.parametrize(
    "text, good, problem",
    [
        (  # a cut-off download: no closing bracket
            f"[{PAIR},\n{PAIR2},",
            [1, 2],
            "2: invalid JSON: the array has no closing ']' (column 50); the file ends there (cut off?)",
        ),
        (f"[{PAIR},\n{PAIR2}] garbage", [1, 2], "2: invalid JSON: text after the array's closing ']' (column 51)"),
        (f"[{PAIR} {PAIR2}]", [1], "1: invalid JSON: Expecting ',' delimiter (column 50); rest of file not read"),
        (f"[,,{PAIR},,", [], "1: invalid JSON: Expecting value (column 2); rest of file not read"),
        (f"[{PAIR},,{PAIR2}]", [1], "1: invalid JSON: Expecting value (column 50); rest of file not read"),
        (f"[{PAIR},\n]", [1], "2: invalid JSON: Expecting value (column 1); rest of file not read"),
    ],
)
def test_a_broken_json_array_is_a_problem_at_the_line_where_it_breaks(tmp_path, capsys, text, good, problem):
    """The array's own syntax is checked as json.loads checks it: the reader used to skip any run of
    commas, stop at the end of the text without its `]` and ignore what followed the `]`, so each of
    these files passed clean. The elements before the break are read, then the one problem line, at
    the line and column where json.loads finds the error."""
    path = tmp_path / "pairs.json"
    path.write_text(text)
    line, column = json_error_at(text)
    assert problem.startswith(f"{line}: ") and f"(column {column})" in problem
    records, problems = validate.read_and_parse([str(path)], "rm")
    assert [r.line for r in records] == good
    assert [str(p) for p in problems] == [f"{path}:{problem}"]
    assert validate.main(["--kind", "rm", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == f"{path}:{problem}"


def json_error_at(text: str) -> tuple[int, int]:
    """The line and column of json.loads' error in `text`."""
    import json

    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(text)
    return err.value.lineno, err.value.colno


@pytest.mark.parametrize(
    "text, reason",
    [
        ("[]", "empty file (an empty JSON array: no records)"),
        (" [ \n ]\n", "empty file (an empty JSON array: no records)"),
        ("  \n\t\n", "empty file (whitespace only)"),
        ("", "empty file"),
    ],
)
def test_an_empty_json_array_is_an_empty_file(tmp_path, capsys, text, reason):
    """`[]` was read as no records and no problem, so the file was not even listed; an empty .jsonl
    is `FILE:0: empty file`, and so is an empty array (or a .json file of whitespace)."""
    path = tmp_path / "pairs.json"
    path.write_text(text)
    assert validate.main(["--kind", "rm", str(path)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == f"{path}:0: {reason}"


def test_well_formed_json_arrays_read_as_json_loads_reads_them(tmp_path):
    import json

    records = [{"prompt": f"q{i}", "chosen": "a, b ] c", "rejected": "[no]"} for i in range(3)]
    texts = {
        "pretty": json.dumps(records, indent=2),
        "one line": json.dumps(records),
        "tight": json.dumps(records, separators=(",", ":")),
        "trailing space": " [ " + " ,\n ".join(map(json.dumps, records)) + " ]  \n\n",
        "crlf": json.dumps(records, indent=1).replace("\n", "\r\n") + "\r\n",
    }
    for name, text in texts.items():
        path = tmp_path / "pairs.json"
        path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
        good, problems = validate.read_and_parse([str(path)], "rm")
        assert problems == [] and len(good) == 3, name
        assert [json.loads(r.raw) for r in good] == records, name


def test_a_records_problem_names_what_it_got_in_jsons_words_and_a_bad_task_name_is_one(tmp_path):
    """A record's problem says what it got as JSON says it (null, an array, an object, a number), not
    Python's class names (NoneType, list, dict, int); a `data_name` that is no task name (a number,
    a list, blank) is a problem of its record: it silently joined the file's own task."""
    import json

    path = tmp_path / "mt.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]},
        [{"role": "user", "content": "q"}],
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "data_name": 5},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "data_name": " "},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "data_name": "qa"},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    good, problems = validate.read_and_parse([str(path)], "sft")
    found = {p.line: p.reason for p in problems}
    assert found[1].endswith("content must be a string, got a number"), found[1]
    assert found[2] == "record must be a JSON object, got an array"
    assert found[3] == "field 'data_name' must be a task name (a non-empty string), got 5"
    assert found[4] == "field 'data_name' must be a task name (a non-empty string), got ' '"
    assert [(r.line, r.task) for r in good] == [(5, "qa"), (6, "mt")]
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": None, "output": "a"}) + "\n")
    _, problems = validate.read_and_parse([str(alpaca)], "sft", fmt="alpaca")
    assert [p.reason for p in problems] == ["field 'instruction' must be a string, got null"]
