"""The token cache (data_formats/token_cache.py): a second build reads the stored samples, equal to
a fresh build; whatever decides the output (data files, tokenizer, template, settings) rebuilds;
a corrupt entry is rebuilt; RELAY_TOKEN_CACHE=off builds every time."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

import data_formats.datasets as datasets
import data_formats.prompt_data as prompt_data
from data_formats import token_cache
from data_formats.datasets import build_preference_data, build_sft_data
from data_formats.prompt_data import build_prompt_data
from data_formats.pt_data import build_pt_data
from data_formats.render import make_template
from pipeline.config import ChatDataConfig, PreferenceDataConfig, PromptDataConfig, TextDataConfig

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "sample"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "tokens"
    monkeypatch.setenv(token_cache.ENV, str(folder))
    return folder


@pytest.fixture
def renders(monkeypatch) -> list:
    """Counts the conversations SFT renders (each is one tokenisation)."""
    calls = []
    real = datasets.render

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "render", counting)
    return calls


def _write(path: Path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _chats(n: int, word: str = "answer") -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"{word} {i}"}]}
        for i in range(n)
    ]


def _sft(cfg, tok, seq_length=256, split="train", **kw):
    return build_sft_data(cfg, tok, make_template(cfg, tok), seq_length, split, **kw)


def _fail(*args, **kwargs):
    raise AssertionError("tokenised (or read) again")


def test_second_build_reads_the_cache_and_equals_the_first(tmp_path, tok, cache, monkeypatch, caplog):
    cfg = ChatDataConfig(train=[_write(tmp_path / "a.jsonl", _chats(5))], template="role_markers")
    with caplog.at_level(logging.INFO):
        first = _sft(cfg, tok)
    first_lines = [r.getMessage() for r in caplog.records if r.name == "data_formats.datasets"]
    assert len(list(cache.glob("*.npz"))) == 1
    monkeypatch.setattr(datasets, "render", _fail)
    monkeypatch.setattr(datasets, "read_and_parse", _fail)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        second = _sft(cfg, tok)
    assert second.samples == first.samples and second.tasks == first.tasks and second.stats == first.stats
    assert [r.getMessage() for r in caplog.records if r.name == "data_formats.datasets"] == first_lines
    assert any("read from the token cache" in r.getMessage() for r in caplog.records)
    assert type(second.samples[0]["input_ids"][0]) is int and type(second.samples[0]["task_id"]) is int


def test_data_file_changes_rebuild(tmp_path, tok, cache, renders, monkeypatch):
    path = tmp_path / "a.jsonl"
    cfg = ChatDataConfig(train=[_write(path, _chats(3))], template="role_markers")
    first = _sft(cfg, tok)
    _sft(cfg, tok)
    assert len(renders) == 3
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched: same bytes
    assert _sft(cfg, tok).samples == first.samples and len(renders) == 6
    _write(path, _chats(3, word="ANSWER"))  # new bytes, same size and mtime as the touched file
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == stat.st_size
    changed = _sft(cfg, tok)
    assert len(renders) == 9 and changed.samples != first.samples
    monkeypatch.setenv(token_cache.ENV, "off")
    assert changed.samples == _sft(cfg, tok).samples


def test_a_new_file_in_a_folder_entry_rebuilds(tmp_path, tok, cache, renders):
    folder = tmp_path / "data"
    folder.mkdir()
    _write(folder / "a.jsonl", _chats(2))
    cfg = ChatDataConfig(train=[str(folder)], template="role_markers")
    assert len(_sft(cfg, tok)) == 2 and len(_sft(cfg, tok)) == 2 and len(renders) == 2
    _write(folder / "b.jsonl", _chats(1))
    assert len(_sft(cfg, tok)) == 3 and len(renders) == 5


def test_tokenizer_changes_rebuild(tmp_path, tok, cache, renders):
    cfg = ChatDataConfig(train=[_write(tmp_path / "a.jsonl", _chats(2))])
    _sft(cfg, tok)
    _sft(cfg, tok)
    assert len(renders) == 2
    added = copy.deepcopy(tok)
    added.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    _sft(cfg, added)
    assert len(renders) == 4
    templated = copy.deepcopy(tok)
    templated.chat_template = tok.chat_template.replace("You are a helpful AI assistant", "You are an assistant")
    other = _sft(cfg, templated)
    assert len(renders) == 6 and other.samples != _sft(cfg, tok).samples and len(renders) == 6


def test_settings_rebuild(tmp_path, tok, cache, renders):
    long_chat = {
        "messages": [
            {"role": "user", "content": "q0"},
            {"role": "assistant", "content": "a0"},
            {"role": "user", "content": "q1 " * 20},
            {"role": "assistant", "content": "a1 " * 20},
        ]
    }
    cfg = ChatDataConfig(train=[_write(tmp_path / "a.jsonl", [long_chat])], template="role_markers")
    full = _sft(cfg, tok, seq_length=256)
    counted = len(renders)
    assert _sft(cfg, tok, seq_length=256).samples == full.samples and len(renders) == counted
    dropped = _sft(cfg, tok, seq_length=30)
    assert dropped.stats["dropped_overlong"] == 1 and len(renders) > counted
    counted = len(renders)
    cfg.truncation = "truncate"
    kept = _sft(cfg, tok, seq_length=30)
    assert kept.stats["truncated"] == 1 and len(renders) > counted
    counted = len(renders)
    _sft(cfg, tok, seq_length=30)
    assert len(renders) == counted  # the truncated build was stored too
    cfg.template = "chat_template"  # another template is another key
    _sft(cfg, tok, seq_length=30)
    assert len(renders) > counted


def test_a_corrupt_entry_is_rebuilt(tmp_path, tok, cache, renders, caplog):
    cfg = ChatDataConfig(train=[_write(tmp_path / "a.jsonl", _chats(3))], template="role_markers")
    first = _sft(cfg, tok)
    (entry,) = cache.glob("*.npz")
    good = entry.read_bytes()
    for damaged in (good[: len(good) // 2], b"not a zip", good[:100] + bytes(len(good) - 100)):
        entry.write_bytes(damaged)
        with caplog.at_level(logging.WARNING):
            assert _sft(cfg, tok).samples == first.samples
        assert "ignoring unreadable entry" in caplog.text
        caplog.clear()
    assert len(renders) == 12
    assert _sft(cfg, tok).samples == first.samples and len(renders) == 12  # the rebuilt entry is whole
    assert not [p for p in cache.iterdir() if p.suffix != ".npz"]  # no temporary files left


def test_an_entry_stored_under_another_key_is_a_miss(tmp_path, tok, cache, renders):
    cfg = ChatDataConfig(train=[_write(tmp_path / "a.jsonl", _chats(2))], template="role_markers")
    first = _sft(cfg, tok)
    (entry,) = cache.glob("*.npz")
    token_cache.write_entry(entry, "another key", token_cache.Built([{"input_ids": [1]}]))
    assert _sft(cfg, tok).samples == first.samples and len(renders) == 4


def test_cache_off(tmp_path, tok, monkeypatch, renders):
    monkeypatch.setenv("RELAY_CACHE", str(tmp_path / "relay"))
    monkeypatch.setenv(token_cache.ENV, "off")
    cfg = ChatDataConfig(train=[_write(tmp_path / "a.jsonl", _chats(2))], template="role_markers")
    assert _sft(cfg, tok).samples == _sft(cfg, tok).samples
    assert len(renders) == 4 and not (tmp_path / "relay").exists()
    monkeypatch.delenv(token_cache.ENV)  # default place: $RELAY_CACHE/tokens
    _sft(cfg, tok)
    assert len(list((tmp_path / "relay" / "tokens").glob("*.npz"))) == 1


def test_skipped_bad_records_replay_their_log_lines(tmp_path, tok, cache, caplog, monkeypatch):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _chats(2)) + "{broken\n" + json.dumps({"text": "x"}) + "\n")
    cfg = ChatDataConfig(train=[str(path)], template="role_markers", on_error="skip")
    with caplog.at_level(logging.INFO):
        first = _sft(cfg, tok)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name != "data_formats.token_cache"]
    assert any("skipping 2 bad record(s)" in m for _, m in lines)
    assert first.stats["skipped_bad"] == 2 and first.stats["samples"] == 2  # both skipped as read, none rendered
    monkeypatch.setattr(datasets, "render", _fail)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        second = _sft(cfg, tok)
    assert [(r.levelno, r.getMessage()) for r in caplog.records if r.name != "data_formats.token_cache"] == lines
    assert second.samples == first.samples and second.stats == first.stats


def _sample_builds(tok) -> dict:
    sft = ChatDataConfig(train=[str(SAMPLE / "sft" / "train")], eval=[str(SAMPLE / "sft" / "valid")])
    train = _sft(sft, tok, 512)
    pt = TextDataConfig(train=[str(SAMPLE / "pt" / "train.jsonl")], eval=[str(SAMPLE / "pt" / "valid.jsonl")])
    rm = PreferenceDataConfig(train=[str(SAMPLE / "rm" / "train.jsonl")], truncation="truncate")
    prompts = PromptDataConfig(train=[str(SAMPLE / "ppo" / "train.jsonl")], eval_fraction=0.2)
    return {
        "sft": (train.samples, train.tasks, train.stats),
        "sft eval": _sft(sft, tok, 512, "eval", tasks=train.tasks).samples,
        "pt": build_pt_data(pt, tok, 128, "train"),
        "pt eval": build_pt_data(pt, tok, 128, "eval"),
        "rm": build_preference_data(rm, tok, make_template(rm, tok), 96, "train"),
        "prompts": build_prompt_data(prompts, tok, make_template(prompts, tok), "train"),
        "prompts eval": build_prompt_data(prompts, tok, make_template(prompts, tok), "eval"),
    }


def test_sample_data_is_identical_with_and_without_the_cache(tok, cache, monkeypatch):
    monkeypatch.setenv(token_cache.ENV, "off")
    plain = _sample_builds(tok)
    monkeypatch.setenv(token_cache.ENV, str(cache))
    written = _sample_builds(tok)
    assert len(list(cache.glob("*.npz"))) == len(plain)
    for module, name in (
        (datasets, "read_and_parse"),
        (datasets, "render"),
        (datasets, "render_scored"),
        (prompt_data, "render_prompt"),
    ):
        monkeypatch.setattr(module, name, _fail)
    read = _sample_builds(tok)
    for name in plain:
        assert written[name] == plain[name] and read[name] == plain[name], name
    assert plain["rm"] and plain["prompts eval"] and plain["pt eval"]


def test_columns_round_trip():
    samples = [
        {"ids": [1, -100, 2**40], "n": 3, "m": 0.1, "text": "héllo ✓", "none": []},
        {"ids": [], "n": -1, "m": float("inf"), "text": "", "none": []},
    ]
    columns, arrays = token_cache.encode_samples(samples)
    assert [kind for _, kind in columns] == ["ints", "int", "float", "str", "ints"]
    assert arrays["c0.values"].dtype == np.int64 and arrays["c4.values"].dtype == np.int32
    assert token_cache.decode_samples(columns, arrays, 2) == samples
    assert token_cache.encode_samples([]) == ([], {})
    assert token_cache.encode_samples([{"x": None}]) is None  # not storable: built every time
    assert token_cache.encode_samples([{"x": 1}, {"y": 1}]) is None


def test_what_is_not_cached(tmp_path, tok):
    cfg = ChatDataConfig(train=["someone/some_dataset"])
    assert token_cache.key_parts("sft", "train", cfg, cfg.train, tok) is None  # a hub dataset: no cheap identity

    class Slow:
        chat_template = None

    assert token_cache.key_parts("sft", "train", cfg, [], Slow()) is None


def test_a_template_that_reads_the_clock_keys_on_the_date(tmp_path, tok):
    cfg = ChatDataConfig(train=[_write(tmp_path / "a.jsonl", _chats(1))])
    dated = copy.deepcopy(tok)
    dated.chat_template = "{{ strftime_now('%Y-%m-%d') }}" + tok.chat_template
    assert token_cache.key_parts("sft", "train", cfg, cfg.train, tok)["date"] is None
    assert token_cache.key_parts("sft", "train", cfg, cfg.train, dated)["date"]
