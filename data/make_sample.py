"""Generate Relay's bundled sample data (all four stages) from a seed.

    python data/make_sample.py                 # rewrites data/sample/ (byte-identical every run)
    python data/make_sample.py --out /tmp/s    # somewhere else

Everything is about one made-up domain, the Kelvra Archipelago, so the stages build on each
other: PT reads prose about the islands, SFT teaches question answering about them (plus a small
second task, coin arithmetic), the reward model learns the house style and PPO pushes the policy
towards it. Every fact and sentence below is invented here; nothing is copied from elsewhere.

The preference is made to be learnable by a 135M model in a few dozen steps: a preferred answer is
one short sentence that opens with the fixed phrase "Per the Kelvra Atlas," and states the right
fact; a rejected answer is evasive, states a wrong fact, rambles without the phrase, or answers
another question (the phrase and a true fact the question did not ask for). SFT answers
use the phrase only about half of the time, so a policy fresh from SFT has room to move towards it.

gold/eval.jsonl is never trained on: 80 questions (every fact once, 32 twice) in wordings no other
file uses, each with its answer key ({"prompt", "island", "attribute", "expected"}). The pipeline
judges its models on it (pipeline/tools/gold.py): does the answer open with the phrase, and state the fact?
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Callable, Optional

SEED = 20240611
PHRASE = "Per the Kelvra Atlas,"
SYSTEM_PROMPTS = (
    "You are the Kelvra Atlas assistant. Answer briefly.",
    "You answer questions about the Kelvra Archipelago in one sentence.",
)

# island, capital, main export, lighthouses, lantern-festival month
ISLANDS = (
    ("Oru", "Tessel", "salt", 3, "March"),
    ("Veskel", "Marrow Bay", "kelp paper", 5, "June"),
    ("Tamarin Rock", "Orlin", "amber", 1, "October"),
    ("Lisk", "Cask", "smoked eel", 4, "January"),
    ("Pellago", "Dunmere", "slate", 7, "August"),
    ("Corvane", "Velo", "copper wire", 2, "May"),
    ("Nimbre", "Pryn", "glass beads", 6, "December"),
    ("Quillon", "Abbot's Cove", "wool", 8, "April"),
    ("Sarth", "Sile", "pearl buttons", 2, "September"),
    ("Ebbmoor", "Rook", "pine tar", 9, "February"),
    ("Haldra", "Tarn", "pear cider", 3, "July"),
    ("Fenwick Reach", "Gale", "hemp rope", 5, "November"),
)
ATTRIBUTES = ("capital", "export", "lighthouses", "festival")
SHELLS_PER_CROWN = 12

QUESTIONS = {
    "capital": (
        "What is the capital of {island}?",
        "Which town is the capital of {island}?",
        "Name the capital of {island}.",
    ),
    "export": (
        "What does {island} export?",
        "What is the main export of {island}?",
        "What is {island} known for selling?",
    ),
    "lighthouses": ("How many lighthouses does {island} have?", "How many lighthouses stand on {island}?"),
    "festival": (
        "When is the lantern festival on {island}?",
        "In which month does {island} hold its lantern festival?",
    ),
}
# Held-out wordings for the gold evaluation (data/sample/gold/): no training file uses them.
GOLD_QUESTIONS = {
    "capital": (
        "Tell me the capital of {island}.",
        "Which town serves as the capital of {island}?",
        "On {island}, which town is the capital?",
    ),
    "export": (
        "What is the chief export of {island}?",
        "Which goods does {island} mainly export?",
        "What product is {island} best known for exporting?",
    ),
    "lighthouses": (
        "How many lighthouses are there on {island}?",
        "What is the number of lighthouses on {island}?",
        "Count the lighthouses of {island} for me.",
    ),
    "festival": (
        "In what month is the lantern festival held on {island}?",
        "Which month is the lantern festival of {island}?",
        "Tell me the month of the lantern festival on {island}.",
    ),
}
FOLLOW_UPS = {
    "capital": "And its capital?",
    "export": "What does it export?",
    "lighthouses": "How many lighthouses does it have?",
    "festival": "When is its lantern festival?",
}
EVASIVE = (
    "I am not sure about that. You could ask someone who has been there.",
    "That is hard to say. Islands change a lot over the years, so I would rather not guess.",
    "Good question! There are many islands out there and they all have their own stories.",
    "I do not have that information right now, sorry.",
)
RAMBLE_OPENERS = (
    "Well, that is a good question. ",
    "Let me think about it for a moment. ",
    "Hmm, as far as I remember, ",
)


def fact_sentence(island: tuple, attribute: str) -> str:
    """The plain statement of one fact, e.g. 'the capital of Oru is Tessel'."""
    name, capital, export, lights, month = island
    return {
        "capital": f"the capital of {name} is {capital}",
        "export": f"the main export of {name} is {export}",
        "lighthouses": f"{name} has {lights} lighthouse{'s' if lights != 1 else ''}",
        "festival": f"the lantern festival on {name} is held in {month}",
    }[attribute]


def capitalise(text: str) -> str:
    return text[0].upper() + text[1:]


def preferred_answer(island: tuple, attribute: str) -> str:
    return f"{PHRASE} {fact_sentence(island, attribute)}."


def plain_answer(island: tuple, attribute: str) -> str:
    return f"{capitalise(fact_sentence(island, attribute))}."


def wrong_island(rng: random.Random, island: tuple, attribute: str) -> tuple:
    """The same island with the attribute's value taken from another island (always different)."""
    index = 1 + ATTRIBUTES.index(attribute)
    others = [o for o in ISLANDS if o[index] != island[index]]
    donor = rng.choice(others)
    return island[:index] + (donor[index],) + island[index + 1 :]


def ask(rng: random.Random, island: tuple, attribute: str) -> str:
    return rng.choice(QUESTIONS[attribute]).format(island=island[0])


# ---------------------------------------------------------------------------------------------
# PT: short prose documents
# ---------------------------------------------------------------------------------------------


def pt_document(rng: random.Random) -> str:
    """A short document about one island (its facts in a random order) or about the coinage."""
    if rng.random() < 0.12:
        crowns = rng.randint(2, 9)
        return (
            f"Coins of the Kelvra Archipelago. One crown is worth {SHELLS_PER_CROWN} shells. "
            f"A fisher who sells a basket for {crowns} crowns receives {crowns * SHELLS_PER_CROWN} shells. "
            "Traders on every island accept both coins."
        )
    island = rng.choice(ISLANDS)
    attributes = list(ATTRIBUTES)
    rng.shuffle(attributes)
    facts = [capitalise(fact_sentence(island, a)) + "." for a in attributes[: rng.randint(2, 4)]]
    opener = rng.choice(
        (
            f"{island[0]} is an island of the Kelvra Archipelago.",
            f"Notes on {island[0]}.",
            f"A traveller's page about {island[0]}.",
            f"{PHRASE} {island[0]} lies in the Kelvra Archipelago.",
        )
    )
    return " ".join([opener] + facts)


def make_pt(rng: random.Random, count: int) -> list[dict]:
    return [{"text": pt_document(rng)} for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# SFT: MFTCoder chatML, two tasks
# ---------------------------------------------------------------------------------------------


def atlas_conversation(rng: random.Random) -> list[dict]:
    """1-3 question/answer rounds about one island, some with a system turn."""
    rounds = []
    if rng.random() < 0.3:
        rounds.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    island = rng.choice(ISLANDS)
    attributes = rng.sample(ATTRIBUTES, rng.choice((1, 1, 2, 3)))
    for turn, attribute in enumerate(attributes):
        question = ask(rng, island, attribute) if turn == 0 else FOLLOW_UPS[attribute]
        styled = rng.random() < 0.5
        answer = preferred_answer(island, attribute) if styled else plain_answer(island, attribute)
        rounds += [{"role": "human", "content": question}, {"role": "bot", "content": answer}]
    return rounds


def coin_conversation(rng: random.Random) -> list[dict]:
    """1-2 rounds of crown/shell arithmetic."""
    rounds = []
    if rng.random() < 0.3:
        rounds.append({"role": "system", "content": "You help traders with Kelvra coins."})
    for _ in range(rng.choice((1, 2))):
        crowns = rng.randint(1, 20)
        if rng.random() < 0.5:
            question = f"How many shells is {crowns} crown{'s' if crowns != 1 else ''}?"
            answer = (
                f"{crowns} crown{'s' if crowns != 1 else ''} is {crowns * SHELLS_PER_CROWN} "
                f"shells, since one crown is {SHELLS_PER_CROWN} shells."
            )
        else:
            question = f"How many crowns is {crowns * SHELLS_PER_CROWN} shells?"
            answer = (
                f"{crowns * SHELLS_PER_CROWN} shells is {crowns} crown{'s' if crowns != 1 else ''}, "
                f"since one crown is {SHELLS_PER_CROWN} shells."
            )
        rounds += [{"role": "human", "content": question}, {"role": "bot", "content": answer}]
    return rounds


def make_sft(
    rng: random.Random, task: str, build: Callable[[random.Random], list[dict]], count: int, start_id: int
) -> list[dict]:
    return [{"id": start_id + i, "data_name": task, "chat_rounds": build(rng)} for i in range(count)]


# ---------------------------------------------------------------------------------------------
# RM: preference pairs (MedicalGPT's question / response_chosen / response_rejected)
# ---------------------------------------------------------------------------------------------


def rejected_answer(rng: random.Random, island: tuple, attribute: str) -> str:
    """Evasive, wrong, a rambling answer without the phrase, or off-topic: the phrase and a true
    fact about the island that the question did not ask for (one quarter each). Without off-topic
    rejections nothing in the pairs ties the reward to the question asked, and PPO learned to answer
    festival and export questions with the island's lighthouses (gold table, issue 33)."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.choice(EVASIVE)
    if kind == 1:
        return plain_answer(wrong_island(rng, island, attribute), attribute)
    if kind == 2:
        return f"{rng.choice(RAMBLE_OPENERS)}{fact_sentence(island, attribute)}, but I could be wrong about that."
    return preferred_answer(island, rng.choice([a for a in ATTRIBUTES if a != attribute]))


def make_rm(rng: random.Random, count: int) -> list[dict]:
    out = []
    for _ in range(count):
        island, attribute = rng.choice(ISLANDS), rng.choice(ATTRIBUTES)
        out.append(
            {
                "question": ask(rng, island, attribute),
                "response_chosen": preferred_answer(island, attribute),
                "response_rejected": rejected_answer(rng, island, attribute),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# PPO: prompts
# ---------------------------------------------------------------------------------------------


def make_ppo(rng: random.Random, count: int) -> list[dict]:
    return [{"prompt": ask(rng, rng.choice(ISLANDS), rng.choice(ATTRIBUTES))} for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# Gold: held-out questions with their answer key (never trained on; see pipeline/tools/gold.py)
# ---------------------------------------------------------------------------------------------


def fact_value(island: tuple, attribute: str) -> str:
    """The answer key of one fact as text: 'Tarn', 'kelp paper', '5', 'June'."""
    return str(island[1 + ATTRIBUTES.index(attribute)])


def gold_record(index: int, question: str, island: tuple, attribute: str) -> dict:
    return {
        "id": f"gold-{index:03d}",
        "prompt": question,
        "island": island[0],
        "attribute": attribute,
        "expected": fact_value(island, attribute),
    }


def make_gold(rng: random.Random, extra: int) -> list[dict]:
    """Every one of the 48 facts once, then `extra` facts a second time with another wording.

    Questions use GOLD_QUESTIONS, wordings no training file contains, so the table measures what
    the model knows rather than which prompts it has seen; the facts are the trained ones.
    """
    facts = [(island, attribute) for island in ISLANDS for attribute in ATTRIBUTES]
    first = {fact: rng.randrange(len(GOLD_QUESTIONS[fact[1]])) for fact in facts}
    asked = [(fact, first[fact]) for fact in facts]
    for fact in rng.sample(facts, extra):
        choices = [i for i in range(len(GOLD_QUESTIONS[fact[1]])) if i != first[fact]]
        asked.append((fact, rng.choice(choices)))
    return [
        gold_record(i, GOLD_QUESTIONS[a][w].format(island=island[0]), island, a)
        for i, ((island, a), w) in enumerate(asked)
    ]


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list[dict]) -> None:
    """One JSON object per line, UTF-8, '\\n' line ends (byte-identical on every platform)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def build_all(seed: int = SEED) -> dict[str, list[dict]]:
    """Every sample file, keyed by its path relative to the sample root.

    Each split draws from its own RNG (seeded from `seed` and its name) so adding records to one
    file never changes another.
    """

    def rng(name: str) -> random.Random:
        return random.Random(f"{seed}:{name}")

    return {
        "pt/train.jsonl": make_pt(rng("pt/train"), 150),
        "pt/valid.jsonl": make_pt(rng("pt/valid"), 16),
        "sft/train/atlas_qa.jsonl": make_sft(rng("sft/train/atlas"), "atlas_qa", atlas_conversation, 200, 0),
        "sft/train/coin_math.jsonl": make_sft(rng("sft/train/coin"), "coin_math", coin_conversation, 40, 1000),
        "sft/valid/atlas_qa.jsonl": make_sft(rng("sft/valid/atlas"), "atlas_qa", atlas_conversation, 24, 2000),
        "sft/valid/coin_math.jsonl": make_sft(rng("sft/valid/coin"), "coin_math", coin_conversation, 8, 3000),
        "rm/train.jsonl": make_rm(rng("rm/train"), 200),
        "rm/valid.jsonl": make_rm(rng("rm/valid"), 40),
        "ppo/train.jsonl": make_ppo(rng("ppo/train"), 64),
        "ppo/valid.jsonl": make_ppo(rng("ppo/valid"), 16),
        "gold/eval.jsonl": make_gold(rng("gold/eval"), 32),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "sample"), help="sample root (default: data/sample)"
    )
    parser.add_argument("--seed", type=int, default=SEED, help="generator seed")
    args = parser.parse_args(argv)
    root = Path(args.out)
    for rel, records in build_all(args.seed).items():
        write_jsonl(root / rel, records)
        print(f"{root / rel}: {len(records)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
