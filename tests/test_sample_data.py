"""The bundled sample data: regenerates byte-identically, validates, and has the promised shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "data" / "sample"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_sample", ROOT / "data" / "make_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(rel: str) -> list[dict]:
    return [json.loads(line) for line in (SAMPLE / rel).read_text(encoding="utf-8").splitlines()]


def test_regenerates_byte_identically(tmp_path):
    gen = load_generator()
    assert gen.main(["--out", str(tmp_path)]) == 0
    shipped = sorted(p.relative_to(SAMPLE) for p in SAMPLE.rglob("*.jsonl"))
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    assert shipped == fresh and len(shipped) == 11
    for rel in shipped:
        assert (tmp_path / rel).read_bytes() == (SAMPLE / rel).read_bytes(), rel


def test_other_seed_gives_other_data():
    gen = load_generator()
    assert gen.build_all(1)["rm/train.jsonl"] != gen.build_all(2)["rm/train.jsonl"]


@pytest.mark.parametrize(
    "kind, paths",
    [
        ("pt", ["pt/train.jsonl", "pt/valid.jsonl"]),
        ("sft", ["sft/train", "sft/valid"]),
        ("rm", ["rm/train.jsonl", "rm/valid.jsonl"]),
        ("prompts", ["ppo/train.jsonl", "ppo/valid.jsonl"]),
        ("prompts", ["gold/eval.jsonl"]),  # gold prompts are PPO-style prompts plus an answer key
    ],
)
def test_validates(kind, paths, capsys):
    from data_formats.validate import main

    extra = ["--seq-length", "200"] if kind == "sft" else []
    assert main(["--kind", kind, *extra, *[str(SAMPLE / p) for p in paths]]) == 0, capsys.readouterr()


def test_sizes():
    sizes = {str(p.relative_to(SAMPLE)): len(p.read_text().splitlines()) for p in SAMPLE.rglob("*.jsonl")}
    assert sizes == {
        "pt/train.jsonl": 150, "pt/valid.jsonl": 16,
        "sft/train/atlas_qa.jsonl": 200, "sft/train/coin_math.jsonl": 40,
        "sft/valid/atlas_qa.jsonl": 24, "sft/valid/coin_math.jsonl": 8,
        "rm/train.jsonl": 200, "rm/valid.jsonl": 40,
        "ppo/train.jsonl": 64, "ppo/valid.jsonl": 16,
        "gold/eval.jsonl": 80,
    }  # fmt: skip


def test_sft_is_mftcoder_chatml_multitask_multiturn():
    convs = []
    for split in ("train", "valid"):
        for path in sorted((SAMPLE / "sft" / split).glob("*.jsonl")):
            for rec in records(f"sft/{split}/{path.name}"):
                assert set(rec) == {"id", "data_name", "chat_rounds"} and rec["data_name"] == path.stem
                roles = [t["role"] for t in rec["chat_rounds"]]
                body = roles[1:] if roles[0] == "system" else roles
                assert body == ["human", "bot"] * (len(body) // 2) and len(body) >= 2, rec["id"]
                convs.append(roles)
    ids = [
        rec["id"]
        for split in ("train", "valid")
        for p in (SAMPLE / "sft" / split).glob("*.jsonl")
        for rec in records(f"sft/{split}/{p.name}")
    ]
    assert len(ids) == len(set(ids))
    with_system = sum(r[0] == "system" for r in convs)
    multi_turn = sum(r.count("human") > 1 for r in convs)
    assert 0.15 * len(convs) < with_system < 0.5 * len(convs)
    assert multi_turn > 0.25 * len(convs)


def test_sft_uses_the_phrase_about_half_the_time():
    gen = load_generator()
    answers = [
        t["content"] for rec in records("sft/train/atlas_qa.jsonl") for t in rec["chat_rounds"] if t["role"] == "bot"
    ]
    share = sum(a.startswith(gen.PHRASE) for a in answers) / len(answers)
    assert 0.35 < share < 0.65


def test_preference_is_the_phrase_and_the_right_fact():
    """Chosen: the phrase and the asked fact. Rejected: without the phrase, or off-topic: the phrase
    and a true fact about the same island that the question did not ask for (about a quarter)."""
    gen = load_generator()
    facts = {gen.fact_sentence(i, a): (i[0], a) for i in gen.ISLANDS for a in gen.ATTRIBUTES}
    for split in ("train", "valid"):
        off_topic = 0
        pairs = records(f"rm/{split}.jsonl")
        for rec in pairs:
            chosen, rejected = rec["response_chosen"], rec["response_rejected"]
            assert chosen.startswith(gen.PHRASE + " ") and chosen[len(gen.PHRASE) + 1 : -1] in facts
            assert chosen != rejected and len(chosen.split()) <= 16
            if gen.PHRASE in rejected:
                island, asked = facts[chosen[len(gen.PHRASE) + 1 : -1]]
                other = facts[rejected[len(gen.PHRASE) + 1 : -1]]
                assert rejected.startswith(gen.PHRASE + " ") and other[0] == island and other[1] != asked
                off_topic += 1
        assert 0.15 * len(pairs) <= off_topic <= 0.35 * len(pairs)


def test_wrong_answers_are_really_wrong():
    gen = load_generator()
    import random

    rng = random.Random(0)
    for island in gen.ISLANDS:
        for attribute in gen.ATTRIBUTES:
            wrong = gen.wrong_island(rng, island, attribute)
            assert gen.fact_sentence(wrong, attribute) != gen.fact_sentence(island, attribute)


def test_ppo_prompts_are_single_questions():
    for split in ("train", "valid"):
        for rec in records(f"ppo/{split}.jsonl"):
            assert set(rec) == {"prompt"} and rec["prompt"].endswith(("?", "."))


def test_gold_is_held_out_and_keyed():
    """Every fact once or twice, in wordings no training, RM or PPO file uses, with its answer key."""
    gen = load_generator()
    gold = records("gold/eval.jsonl")
    islands = {i[0]: i for i in gen.ISLANDS}
    assert {(r["island"], r["attribute"]) for r in gold} == {(i[0], a) for i in gen.ISLANDS for a in gen.ATTRIBUTES}
    for r in gold:
        assert set(r) == {"id", "prompt", "island", "attribute", "expected"}
        assert r["expected"] == gen.fact_value(islands[r["island"]], r["attribute"]) and r["island"] in r["prompt"]
    training_wordings = {q for qs in gen.QUESTIONS.values() for q in qs} | set(gen.FOLLOW_UPS.values())
    gold_wordings = {q for qs in gen.GOLD_QUESTIONS.values() for q in qs}
    assert not training_wordings & gold_wordings
    assert len({r["prompt"] for r in gold}) == len(gold)
