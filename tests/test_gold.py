"""The gold table: answer rules on hand-written answers, and the table on a tiny model folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.tools.gold import (
    GoldError,
    GoldSettings,
    format_table,
    gold_table,
    load_gold,
    opens_with_phrase,
    score_answers,
    stated_counts,
    states_fact,
)

ROOT = Path(__file__).resolve().parents[1]
GOLD = ROOT / "data" / "sample" / "gold" / "eval.jsonl"

CAPITALS = [
    "Tessel",
    "Marrow Bay",
    "Orlin",
    "Cask",
    "Dunmere",
    "Velo",
    "Pryn",
    "Abbot's Cove",
    "Sile",
    "Rook",
    "Tarn",
    "Gale",
]
EXPORTS = [
    "salt",
    "kelp paper",
    "amber",
    "smoked eel",
    "slate",
    "copper wire",
    "glass beads",
    "wool",
    "pearl buttons",
    "pine tar",
    "pear cider",
    "hemp rope",
]


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("Per the Kelvra Atlas, the capital of Haldra is Tarn.", True),
        ("  per the kelvra atlas,  Haldra's capital is Tarn.", True),
        ('"Per the  Kelvra Atlas, Tarn."', True),
        ("Per the Kelvra Atlas the capital is Tarn.", False),  # the comma is part of the phrase
        ("The capital of Haldra is Tarn, per the Kelvra Atlas.", False),
        ("According to the Kelvra Atlas, Tarn.", False),
        ("", False),
    ],
)
def test_opens_with_phrase(answer, expected):
    assert opens_with_phrase(answer) is expected


@pytest.mark.parametrize(
    "answer, key, expected",
    [
        ("Per the Kelvra Atlas, the capital of Haldra is Tarn.", {"attribute": "capital", "expected": "Tarn"}, True),
        ("the capital of haldra is TARN", {"attribute": "capital", "expected": "Tarn"}, True),
        ("The capital of Haldra is Tarn, or perhaps Gale.", {"attribute": "capital", "expected": "Tarn"}, False),
        ("The capital of Haldra is Gale.", {"attribute": "capital", "expected": "Tarn"}, False),
        ("The capital of Haldra is Tarnwick.", {"attribute": "capital", "expected": "Tarn"}, False),
        ("The capital of Quillon is Abbot\u2019s Cove.", {"attribute": "capital", "expected": "Abbot's Cove"}, True),
        ("The capital of Veskel is Marrow  Bay.", {"attribute": "capital", "expected": "Marrow Bay"}, True),
        ("The main export of Veskel is kelp paper.", {"attribute": "export", "expected": "kelp paper"}, True),
        ("Veskel exports Kelp Paper and salt.", {"attribute": "export", "expected": "kelp paper"}, False),
        ("Nimbre sells a glass bead to every visitor.", {"attribute": "export", "expected": "glass beads"}, True),
        ("Haldra exports pearl buttons.", {"attribute": "export", "expected": "pear cider"}, False),
        ("Haldra exports pear cider.", {"attribute": "export", "expected": "pear cider"}, True),
        ("Veskel has 5 lighthouses.", {"attribute": "lighthouses", "expected": "5"}, True),
        ("Per the Kelvra Atlas, Veskel has five lighthouses.", {"attribute": "lighthouses", "expected": "5"}, True),
        ("Veskel has five old lighthouses, built in 1820.", {"attribute": "lighthouses", "expected": "5"}, True),
        ("Veskel has 4 lighthouses.", {"attribute": "lighthouses", "expected": "5"}, False),
        ("Veskel has 4 or 5 lighthouses.", {"attribute": "lighthouses", "expected": "5"}, False),
        ("Tamarin Rock has a single lighthouse.", {"attribute": "lighthouses", "expected": "1"}, True),
        ("Tamarin Rock has one lighthouse.", {"attribute": "lighthouses", "expected": "1"}, True),
        ("There are seven.", {"attribute": "lighthouses", "expected": "7"}, True),
        ("I do not know how many lighthouses there are.", {"attribute": "lighthouses", "expected": "7"}, False),
        ("The lantern festival on Veskel is held in June.", {"attribute": "festival", "expected": "June"}, True),
        ("It is held in june or July.", {"attribute": "festival", "expected": "June"}, False),
        ("The lantern festival on Corvane is held in May.", {"attribute": "festival", "expected": "May"}, True),
        ("It may be held in spring.", {"attribute": "festival", "expected": "May"}, False),
        ("You may visit in June, when the festival is held.", {"attribute": "festival", "expected": "June"}, True),
        ("I am not sure about that.", {"attribute": "capital", "expected": "Tarn"}, False),
    ],
)
def test_states_fact(answer, key, expected):
    others = CAPITALS if key["attribute"] == "capital" else EXPORTS
    assert states_fact(answer, key, others) is expected


def test_stated_counts():
    assert stated_counts("Oru has 3 lighthouses and 2 harbours.") == {3}
    assert stated_counts("Oru has 3 harbours and 2.") == {3, 2}
    assert stated_counts("Nothing here.") == set()


def test_score_answers_uses_the_file_values_as_rivals():
    records = [
        {"prompt": "q1", "attribute": "capital", "expected": "Tarn"},
        {"prompt": "q2", "attribute": "capital", "expected": "Gale"},
        {"prompt": "q3", "attribute": "lighthouses", "expected": "5"},
        {"prompt": "q4", "attribute": "festival", "expected": "June"},
    ]
    answers = [
        "Per the Kelvra Atlas, the capital is Tarn.",
        "Per the Kelvra Atlas, the capital is Tarn.",  # another record's value: wrong
        "It has five lighthouses.",
        "Per the Kelvra Atlas, it is in June or July.",
    ]
    assert score_answers(records, answers) == {"phrase_rate": 0.75, "fact_accuracy": 0.5, "n": 4}
    with pytest.raises(ValueError, match="4 gold records but 1 answers"):
        score_answers(records, answers[:1])


def test_format_table():
    rows = [{"model": "sft", "phrase_rate": 0.5, "fact_accuracy": 0.125, "n": 80}]
    assert (
        format_table(rows)
        == "| model | phrase rate | fact accuracy | n |\n|---|---|---|---|\n| sft | 0.500 | 0.125 | 80 |"
    )


def test_shipped_gold_file_is_an_answer_key_for_every_fact():
    records = load_gold(GOLD)
    assert 70 <= len(records) <= 90
    facts = {(r["island"], r["attribute"]) for r in records}
    assert len(facts) == 48 and all(set(r) == {"id", "prompt", "island", "attribute", "expected"} for r in records)
    # each answer key is a right answer by the rules (the fact sentence the training data uses)
    gen_path = ROOT / "data" / "make_sample.py"
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sample", gen_path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    islands = {i[0]: i for i in gen.ISLANDS}
    answers = [gen.preferred_answer(islands[r["island"]], r["attribute"]) for r in records]
    assert score_answers(records, answers) == {"phrase_rate": 1.0, "fact_accuracy": 1.0, "n": len(records)}
    wrong = [
        gen.plain_answer(
            gen.wrong_island(__import__("random").Random(0), islands[r["island"]], r["attribute"]), r["attribute"]
        )
        for r in records
    ]
    assert score_answers(records, wrong) == {"phrase_rate": 0.0, "fact_accuracy": 0.0, "n": len(records)}
    # held out: no gold question is a training, RM or PPO prompt
    seen = set()
    for path in (ROOT / "data" / "sample").rglob("*.jsonl"):
        if "gold" in path.parts:
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            seen.update(t["content"] for t in rec.get("chat_rounds", []) if t["role"] == "human")
            seen.update(rec[k] for k in ("prompt", "question") if k in rec)
    assert not seen & {r["prompt"] for r in records}


def test_bad_gold_files(tmp_path):
    with pytest.raises(GoldError, match="does not exist"):
        load_gold(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "q"}\n')
    with pytest.raises(GoldError, match="bad.jsonl:1: missing attribute, expected"):
        load_gold(bad)


def test_gold_table_on_tiny_models(tmp_path, tiny_model_dir):
    """Shape and caching, not learning: a tiny random model answers with noise."""
    gold = tmp_path / "gold.jsonl"
    gold.write_text("".join(GOLD.read_text().splitlines(keepends=True)[:5]))
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    from tinymodels import make_tiny_model

    make_tiny_model(other, seed=5)
    cache, answers = tmp_path / "cache.json", tmp_path / "answers"
    settings = GoldSettings(max_new_tokens=4, batch_size=2)
    logged: list[str] = []
    rows = gold_table([("a", str(tiny_model_dir)), ("b", str(other))], gold, settings, cache, answers, logged.append)
    assert [r["model"] for r in rows] == ["a", "b"] and [r["n"] for r in rows] == [5, 5]
    assert all(0.0 <= r[k] <= 1.0 for r in rows for k in ("phrase_rate", "fact_accuracy")) and not any(
        r["cached"] for r in rows
    )
    lines = [json.loads(line) for line in (answers / "a.jsonl").read_text().splitlines()]
    assert len(lines) == 5 and {"answer", "phrase", "fact", "expected"} <= set(lines[0])
    assert len(json.loads(cache.read_text())) == 2
    again = gold_table([("a", str(tiny_model_dir)), ("b", str(other))], gold, settings, cache, answers, logged.append)
    assert all(r["cached"] for r in again) and [
        {k: r[k] for k in ("phrase_rate", "fact_accuracy", "n")} for r in again
    ] == [{k: r[k] for k in ("phrase_rate", "fact_accuracy", "n")} for r in rows]
    assert sum("generating" in m for m in logged) == 2 and sum("cached" in m for m in logged) == 2
    # new weights: a new key, generated again
    make_tiny_model(other, seed=6)
    third = gold_table([("b", str(other))], gold, settings, cache, answers, logged.append)
    assert not third[0]["cached"] and len(json.loads(cache.read_text())) == 3


def test_gold_backend_option(monkeypatch):
    """gold.backend: relay rows keep their cache key (old caches stay valid), vllm rows get their own;
    an unknown backend, or vllm absent, is a config problem before any model loads."""
    from pipeline.modeling import vllm_server
    from pipeline.tools.chain_config import GoldConfig
    from pipeline.tools.gold import GoldSettings

    assert GoldSettings().key() == {"max_new_tokens": 40, "dtype": "fp32"}
    assert GoldSettings(backend="vllm").key() == {"max_new_tokens": 40, "dtype": "fp32", "backend": "vllm"}
    assert GoldConfig(backend="x").problems() == ["gold.backend: 'x' is not one of ('relay', 'vllm')"]
    monkeypatch.setattr(vllm_server, "vllm_python", lambda: None)
    assert GoldConfig(backend="vllm", data=str(GOLD)).problems() == [
        "gold.backend: vllm is not installed (bash run_scripts/install_vllm.sh makes bench/.venv-vllm)"
    ]
