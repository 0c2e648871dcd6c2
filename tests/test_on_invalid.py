"""data.on_error=skip (issue 32): bad records are left out knowingly: one grouped summary (reason,
count, first lines) on the console and in the run folder, the count in the manifest; a file with
no good record is still an error; `relay show` groups problems as `relay validate` does."""

from __future__ import annotations

import json
import logging

import pytest
from stagerun import run_stage
from test_pt_sft import fresh_accelerate_state  # noqa: F401  (autouse: fresh accelerate state, one intra-op thread)

from data_formats import show, validate
from pipeline.config import ConfigError

GOOD = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]}
BAD_ORDER = {"messages": [{"role": "assistant", "content": "I speak first."}, {"role": "user", "content": "x"}]}
EMPTY = {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "y"}]}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _cfg(tiny_model_dir, files, out, on_error="skip"):
    from stages.sft import SFTConfig

    cfg = SFTConfig()
    cfg.model.path, cfg.output_dir = str(tiny_model_dir), str(out)
    cfg.data.train, cfg.data.eval, cfg.data.on_error = [str(f) for f in files], [], on_error
    cfg.data.template = "role_markers"
    cfg.train.max_steps, cfg.train.batch_size, cfg.train.grad_accum, cfg.train.seq_length = 1, 1, 1, 64
    cfg.train.eval_steps, cfg.train.warmup = 0, 0
    cfg.lora.r = 4
    cfg.checkpoint.resume, cfg.checkpoint.save_interval = False, "1000h"
    cfg.tracking.trackers = []
    return cfg


def test_skip_writes_a_grouped_report_and_counts_it_in_the_manifest(tmp_path, tiny_model_dir, caplog, monkeypatch):
    from stages.sft import SFTStage

    monkeypatch.setenv("RELAY_TOKEN_CACHE", "off")
    data = _write(tmp_path / "chat.jsonl", [GOOD, BAD_ORDER, GOOD, BAD_ORDER, BAD_ORDER, EMPTY, GOOD])
    with caplog.at_level(logging.WARNING):
        run = run_stage(SFTStage, _cfg(tiny_model_dir, [data], tmp_path / "run"))
    assert [s["source"] for s in run.train_samples] == [f"{data}:1", f"{data}:3", f"{data}:7"]
    grouped = [
        f"{data}:2: 3 records: turn 0: conversation must start with a user turn, got assistant (lines 2, 4-5)",
        f"{data}:6: messages[0]: empty content",
    ]
    assert (tmp_path / "run" / "skipped_records.txt").read_text().splitlines() == [
        "sft train data: 4 record(s) skipped (data.on_error=skip)"
    ] + [f"  {line}" for line in grouped]
    assert [f"skipped {line}" for line in grouped] == [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("skipped")
    ]
    manifest = json.loads((tmp_path / "run" / "merged" / "manifest.json").read_text())
    assert manifest["skipped_records"] == {
        "count": 4,
        "by_split": {
            "sft train data": {
                "turn 0: conversation must start with a user turn, got assistant": 3,
                "messages[0]: empty content": 1,
            }
        },
    }


def test_a_file_with_no_good_record_is_still_an_error(tmp_path, tiny_model_dir, monkeypatch):
    from stages.sft import SFTStage

    monkeypatch.setenv("RELAY_TOKEN_CACHE", "off")
    good = _write(tmp_path / "good.jsonl", [GOOD] * 3)
    bad = _write(tmp_path / "bad.jsonl", [BAD_ORDER, EMPTY])
    stage = SFTStage(_cfg(tiny_model_dir, [good, bad], tmp_path / "run"))
    with pytest.raises(ConfigError) as err:
        stage.validate()
    assert err.value.problems == [
        f"{bad}:0: every record of this file is bad (2 problem(s)); data.on_error=skip skips "
        "bad records, not whole files: fix the file or take it out of the data paths"
    ]


def test_show_groups_problems_as_validate_does(tmp_path, capsys):
    data = _write(tmp_path / "chat.jsonl", [GOOD] + [BAD_ORDER] * 5)
    assert show.main([str(data), "--template", "role_markers", "-n", "0"]) == 1
    shown = capsys.readouterr().err.splitlines()
    assert validate.main([str(data)]) == 1
    assert shown == [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{data}:")][:1]
    assert shown == [
        f"{data}:2: 5 records: turn 0: conversation must start with a user turn, got assistant (lines 2-6)"
    ]
