"""Record formats, task naming, splits, truncation policy, multitask sampling, and the PT, RM and
PPO builders."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from data_formats.collate import Collator
from data_formats.conversation import Turn
from data_formats.datasets import build_preference_data, build_sft_data, in_eval_fraction
from data_formats.prompt_data import build_prompt_data
from data_formats.pt_data import build_pt_data
from data_formats.render import IGNORE_INDEX, make_template, render
from data_formats.validate import read_and_parse
from pipeline.config import ChatDataConfig, PreferenceDataConfig, PromptDataConfig, TextDataConfig


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _write(path: Path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _chat(i, turns=1, data_name=None):
    rounds = []
    for k in range(turns):
        rounds += [
            {"role": "user", "content": f"question {i}.{k}"},
            {"role": "assistant", "content": f"answer {i}.{k}"},
        ]
    record = {"messages": rounds}
    if data_name:
        record["data_name"] = data_name
    return record


@pytest.mark.parametrize(
    "record",
    [
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        {"chat_rounds": [{"role": "human", "content": "Q"}, {"role": "bot", "content": "A"}]},
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
        {"prompt": "Q", "response": "A"},
        {"question": "Q", "answer": "A"},
        {"input": "Q", "output": "A"},
        {"instruction": "Q", "output": "A"},
    ],
)
def test_every_conversation_format(tmp_path, record):
    good, problems = read_and_parse([_write(tmp_path / "f.jsonl", [record])], "sft")
    assert problems == [] and good[0].value.turns == [Turn("user", "Q"), Turn("assistant", "A")]


def test_task_naming_and_task_ids_through_collation(tmp_path, tok):
    a = _write(tmp_path / "alpha.jsonl", [_chat(0), _chat(1, data_name="named")])
    folder = tmp_path / "beta_dir"
    _write(folder / "part.jsonl", [_chat(2)])
    cfg = ChatDataConfig(train=[a, str(folder)])
    data = build_sft_data(cfg, tok, make_template(cfg, tok), 256, "train")
    assert data.tasks == ["alpha", "beta_dir", "named"]
    assert [data.tasks[s["task_id"]] for s in data.samples] == ["alpha", "named", "beta_dir"]
    batch = Collator(tok.pad_token_id)(data.samples)
    for row, sample in enumerate(data.samples):
        n = len(sample["input_ids"])
        assert batch["task_ids"][row, :n].tolist() == [sample["task_id"]] * n
        assert (batch["task_ids"][row, n:] == -1).all()
    evaluated = build_sft_data(
        ChatDataConfig(train=[a], eval=[str(folder)]), tok, make_template(cfg, tok), 256, "eval", tasks=data.tasks
    )
    assert evaluated.tasks == data.tasks and evaluated.samples[0]["task_id"] == 1


def test_eval_fraction_split_is_deterministic_and_disjoint(tmp_path, tok):
    path = _write(tmp_path / "t.jsonl", [_chat(i) for i in range(40)])
    cfg = ChatDataConfig(train=[path], eval_fraction=0.25)
    template = make_template(cfg, tok)
    train = [s["source"] for s in build_sft_data(cfg, tok, template, 256, "train").samples]
    held = [s["source"] for s in build_sft_data(cfg, tok, template, 256, "eval").samples]
    assert set(train).isdisjoint(held) and len(train) + len(held) == 40 and held
    lines = Path(path).read_text().splitlines()
    assert held == [f"{path}:{i + 1}" for i, line in enumerate(lines) if in_eval_fraction(line, 0.25)]
    assert build_sft_data(ChatDataConfig(train=[path]), tok, template, 256, "eval").samples == []
    capped = build_sft_data(ChatDataConfig(train=[path], max_samples=3), tok, template, 256, "train")
    assert [s["source"] for s in capped.samples] == [f"{path}:{i}" for i in (1, 2, 3)]


def test_truncation_policies(tmp_path, tok, caplog):
    path = _write(tmp_path / "t.jsonl", [_chat(0, turns=3), _chat(1, turns=1)])
    cfg = ChatDataConfig(train=[path], template="role_markers")
    template = make_template(cfg, tok)
    conv = read_and_parse([path], "sft")[0][0].value
    one_turn = render(type(conv)(conv.turns[:2]), tok, template)[0]
    two_turns = render(type(conv)(conv.turns[:4]), tok, template)[0]
    full = render(conv, tok, template)[0]
    limit = len(two_turns) + 1
    assert len(full) > limit
    dropped = build_sft_data(cfg, tok, template, limit, "train")
    assert dropped.stats["dropped_overlong"] == 1 and [s["source"] for s in dropped.samples] == [f"{path}:2"]
    cfg.truncation = "truncate"
    kept = build_sft_data(cfg, tok, template, limit, "train")
    assert kept.stats["truncated"] == 1 and kept.samples[0]["input_ids"] == two_turns
    assert (
        tok.decode([x for x in kept.samples[0]["labels"] if x != IGNORE_INDEX])
        == "answer 0.0<|im_end|>answer 0.1<|im_end|>"
    )
    tiny = build_sft_data(cfg, tok, template, len(one_turn) - 1, "train")
    assert tiny.stats["dropped_overlong"] == 2 and tiny.samples == []


@pytest.mark.parametrize("truncation", ["drop", "truncate"])
def test_every_builder_warns_of_the_overlong_samples_it_drops_as_sft_does(tmp_path, tok, caplog, truncation):
    """Overlong preference pairs (RM, DPO) and KTO answers were dropped with an INFO line alone, so
    `relay validate` of such a config said nothing of them; each builder now warns as SFT's does.
    Under `truncate` the pair and the KTO answer still drop: the answer alone is over seq_length."""
    from data_formats.unpaired import build_kto_data

    long = "word " * 100
    sft = _write(
        tmp_path / "sft.jsonl",
        [_chat(0), {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": long}]}],
    )
    pairs = _write(
        tmp_path / "pairs.jsonl",
        [{"prompt": "q", "chosen": "yes", "rejected": "no"}, {"prompt": "q", "chosen": long, "rejected": "no"}],
    )
    kto = _write(
        tmp_path / "kto.jsonl",
        [{"prompt": "q", "completion": "yes", "label": True}, {"prompt": "q", "completion": long, "label": False}],
    )
    with caplog.at_level(logging.WARNING):
        cfg = ChatDataConfig(train=[sft], truncation=truncation)
        assert len(build_sft_data(cfg, tok, make_template(cfg, tok), 64, "train")) == 1
        cfg = PreferenceDataConfig(train=[pairs], truncation=truncation)
        assert len(build_preference_data(cfg, tok, make_template(cfg, tok), 64, "train")) == 1
        cfg = ChatDataConfig(train=[kto], truncation=truncation)
        assert len(build_kto_data(cfg, tok, make_template(cfg, tok), 64, "train")) == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "sft train data: 1 sample(s) dropped overlong",
        "rm train data: 1 pair(s) dropped overlong",
        "kto train data: 1 sample(s) dropped overlong",
    ]


def test_pt_data_from_txt_and_jsonl(tmp_path, tok):
    (tmp_path / "a.txt").write_text("first document", encoding="utf-8")
    jl = _write(tmp_path / "b.jsonl", [{"text": "second one"}, {"body": "third"}])
    cfg = TextDataConfig(train=[str(tmp_path / "a.txt"), jl])
    from data_formats.sources import DataError

    with pytest.raises(DataError, match="b.jsonl:2: missing field 'text'"):
        build_pt_data(cfg, tok, 8, "train")
    cfg.on_error = "skip"
    rows = build_pt_data(cfg, tok, 8, "train")
    stream = sum((r["input_ids"] for r in rows), [])
    expected = (
        tok("first document", add_special_tokens=False)["input_ids"]
        + [tok.eos_token_id]
        + tok("second one", add_special_tokens=False)["input_ids"]
        + [tok.eos_token_id]
    )
    assert stream == expected and all(len(r["input_ids"]) <= 8 for r in rows)


def test_preference_and_prompt_data(tmp_path, tok):
    path = _write(
        tmp_path / "p.jsonl",
        [
            {"question": "Q1", "response_chosen": "good", "response_rejected": "bad", "m": 0.5},
            {
                "prompt": [{"role": "user", "content": "Q2"}],
                "chosen": [{"role": "assistant", "content": "yes"}],
                "rejected": [{"role": "assistant", "content": "no"}],
                "m": 1,
            },
        ],
    )
    cfg = PreferenceDataConfig(train=[path], template="role_markers", margin_field="m")
    pairs = build_preference_data(cfg, tok, make_template(cfg, tok), 64, "train")
    # Each side ends at the answer's end-of-turn token, where the reward is read (not the "\n" after it).
    assert tok.decode(pairs[0]["chosen_input_ids"]) == "<s>human\nQ1<s>bot\ngood<|im_end|>"
    assert tok.decode(pairs[1]["rejected_input_ids"]) == "<s>human\nQ2<s>bot\nno<|im_end|>"
    assert [p["margin"] for p in pairs] == [0.5, 1.0]
    # The format is detected per file, so the two prompt formats live in two files.
    simple = _write(tmp_path / "q1.jsonl", [{"prompt": "Hello"}])
    prompts = _write(
        tmp_path / "q2.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "S"},
                    {"role": "user", "content": "old " * 30},
                    {"role": "assistant", "content": "reply"},
                    {"role": "user", "content": "new"},
                ]
            },
        ],
    )
    pcfg = PromptDataConfig(
        train=[simple, prompts], template="role_markers", max_prompt_length=20, truncation="truncate"
    )
    out = build_prompt_data(pcfg, tok, make_template(pcfg, tok), "train")
    assert [p["text"] for p in out] == ["<s>human\nHello<s>bot\n", "<s>system\nS\n<s>human\nnew<s>bot\n"]
    pcfg.truncation = "drop"
    assert len(build_prompt_data(pcfg, tok, make_template(pcfg, tok), "train")) == 1
