"""Generate Relay's general-knowledge data: a multiple-choice benchmark, a held-out general text and
a general replay corpus, all written for Relay (no text copied from elsewhere; same licence as Relay).

    python data/general/make_general.py            # rewrites the files below (byte-identical every run)

- `tasks/general_mc.jsonl`: everyday questions with four choices (arithmetic, geography, science,
  the calendar, animals, language) that a small general model answers partly; the harness task
  `relay_general_mc` (`tasks/general_mc.yaml`) scores them by log-likelihood of each choice.
- `tasks/general_text.jsonl`: short held-out documents of plain general prose; the harness task
  `relay_general_text` (`tasks/general_text.yaml`) gives the model's perplexity on them.
- `train.jsonl`: general prose for replay (`{"text"}` PT documents), mixed back into a domain run
  with `data.weights`; its sentences come from other tables than the held-out text and the questions.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 20261127
HERE = Path(__file__).resolve().parent

# question, the right answer, three wrong answers
QUESTIONS = (
    ("What is 2 + 2?", "four", ("three", "five", "six")),
    ("What is 5 + 3?", "eight", ("seven", "nine", "two")),
    ("What is 10 - 4?", "six", ("four", "five", "three")),
    ("What is 3 times 3?", "nine", ("six", "three", "one")),
    ("What is 12 divided by 4?", "three", ("four", "eight", "two")),
    ("What is half of 10?", "five", ("two", "eight", "ten")),
    ("How many days are there in a week?", "seven", ("five", "ten", "twelve")),
    ("How many months are there in a year?", "twelve", ("ten", "seven", "thirty")),
    ("Which month comes after January?", "February", ("March", "December", "June")),
    ("Which day comes after Monday?", "Tuesday", ("Sunday", "Friday", "Thursday")),
    ("What is the capital of France?", "Paris", ("Berlin", "Madrid", "Rome")),
    ("What is the capital of Japan?", "Tokyo", ("Beijing", "Seoul", "Bangkok")),
    ("What is the capital of Italy?", "Rome", ("Paris", "Vienna", "Athens")),
    ("What is the capital of Germany?", "Berlin", ("Munich", "Paris", "Warsaw")),
    ("What is the capital of the United Kingdom?", "London", ("Dublin", "Paris", "Edinburgh")),
    ("What is the capital of Spain?", "Madrid", ("Lisbon", "Barcelona", "Rome")),
    ("On which continent is Egypt?", "Africa", ("Europe", "South America", "Australia")),
    ("On which continent is Brazil?", "South America", ("Asia", "Europe", "Africa")),
    ("Which planet do we live on?", "Earth", ("Mars", "Jupiter", "the Moon")),
    ("Which planet is known as the Red Planet?", "Mars", ("Venus", "Saturn", "Neptune")),
    ("What gas do people need to breathe?", "oxygen", ("helium", "carbon monoxide", "neon")),
    ("What do plants need from the Sun to grow?", "light", ("sound", "salt", "sand")),
    ("What is ice made of?", "frozen water", ("glass", "sugar", "salt")),
    ("Which organ pumps blood through the body?", "the heart", ("the lungs", "the stomach", "the skin")),
    ("How many legs does a spider have?", "eight", ("six", "four", "ten")),
    ("How many legs does a dog have?", "four", ("two", "six", "eight")),
    ("Which animal is known for barking?", "the dog", ("the cat", "the fish", "the cow")),
    ("Which bird cannot fly?", "the penguin", ("the eagle", "the sparrow", "the pigeon")),
    ("What do bees make?", "honey", ("milk", "silk", "wool")),
    ("Which animal is the largest on Earth?", "the blue whale", ("the elephant", "the giraffe", "the shark")),
    ("What colour is the sky on a clear day?", "blue", ("green", "red", "brown")),
    ("What colour are ripe bananas?", "yellow", ("blue", "purple", "black")),
    ("What colour do you get by mixing blue and yellow?", "green", ("red", "orange", "white")),
    ("In which direction does the Sun rise?", "the east", ("the west", "the north", "the south")),
    ("Which season comes after winter?", "spring", ("autumn", "summer", "winter")),
    ("What is the opposite of hot?", "cold", ("warm", "big", "fast")),
    ("What is the opposite of up?", "down", ("left", "over", "high")),
    ("What is the plural of child?", "children", ("childs", "childes", "childer")),
    ("Which word is a fruit?", "apple", ("carrot", "bread", "cheese")),
    ("Which of these is a vegetable?", "carrot", ("banana", "cherry", "grape")),
    ("Where do fish live?", "in water", ("in trees", "in the desert", "in the sky")),
    ("What falls from clouds when it rains?", "water", ("sand", "leaves", "stones")),
    ("How many sides does a triangle have?", "three", ("four", "five", "six")),
    ("How many sides does a square have?", "four", ("three", "five", "eight")),
    ("What shape is a ball?", "round", ("square", "flat", "triangular")),
    ("Which metal is attracted by a magnet?", "iron", ("gold", "aluminium", "copper")),
    ("What do we call frozen rain that falls as soft white flakes?", "snow", ("fog", "dew", "smoke")),
    ("Which instrument has black and white keys?", "the piano", ("the drum", "the violin", "the flute")),
)

# Held-out prose: never trained on (the replay corpus below is built from other tables).
HELD_OUT = (
    "A river begins as rain and melting snow high in the hills. Small streams join together as they flow "
    "downhill, and the water grows wider and slower as it nears the sea. Towns were often built beside "
    "rivers because the water was useful for drinking, farming and travel.",
    "Trees lose water through their leaves on warm days. In autumn many trees drop their leaves to save "
    "water and energy during the cold months. In spring new leaves open, and the tree begins to grow again.",
    "A library lends books to the people who live nearby. Visitors can read quietly at the tables, borrow "
    "books for a few weeks, and ask the librarian for help finding what they need.",
    "Bicycles are a simple and cheap way to travel. Pushing the pedals turns a chain, and the chain turns "
    "the back wheel. Riders should wear a helmet and use lights when it is dark.",
    "Most people sleep for seven to nine hours each night. Sleep helps the body rest and the mind remember "
    "what it learned during the day. A regular bedtime makes it easier to fall asleep.",
    "Clouds form when warm air rises and cools. The water vapour in the air turns into tiny drops, and when "
    "the drops grow heavy enough they fall as rain. In very cold air they fall as snow instead.",
    "A good map shows roads, rivers, towns and hills, and has a scale so that distances can be measured. "
    "North is usually at the top of the page.",
    "Children learn to count on their fingers before they learn to add and subtract on paper. Later they "
    "learn to multiply and divide, and to work with fractions such as one half and one quarter.",
)

# Replay corpus: everyday topics, each a table of facts and a few sentence patterns.
COUNTRIES = (
    ("Canada", "Ottawa", "North America", "English and French"),
    ("Australia", "Canberra", "Oceania", "English"),
    ("India", "New Delhi", "Asia", "Hindi and English"),
    ("Kenya", "Nairobi", "Africa", "Swahili and English"),
    ("Mexico", "Mexico City", "North America", "Spanish"),
    ("Norway", "Oslo", "Europe", "Norwegian"),
    ("Argentina", "Buenos Aires", "South America", "Spanish"),
    ("Egypt", "Cairo", "Africa", "Arabic"),
    ("Poland", "Warsaw", "Europe", "Polish"),
    ("Thailand", "Bangkok", "Asia", "Thai"),
    ("Portugal", "Lisbon", "Europe", "Portuguese"),
    ("Peru", "Lima", "South America", "Spanish"),
)
COUNTRY_PATTERNS = (
    "{0} is a country in {2}. Its capital is {1}, and people there speak {3}.",
    "The capital city of {0} is {1}. {0} lies in {2}.",
    "Many visitors travel to {1}, the capital of {0}. The main language of {0} is {3}.",
)
FOODS = (
    ("rice", "boiled in water", "a side dish"),
    ("soup", "cooked slowly in a pot", "a warm meal"),
    ("an omelette", "made from beaten eggs in a pan", "a quick breakfast"),
    ("a salad", "made from fresh leaves and vegetables", "a light meal"),
    ("pasta", "boiled until soft and served with a sauce", "a common dinner"),
    ("porridge", "made from oats and milk", "a filling breakfast"),
)
FOOD_PATTERNS = (
    "{0} is {1}. Many families eat it as {2}.",
    "To prepare {0}, it is {1}. It is often eaten as {2}.",
)
JOBS = (
    ("A teacher", "helps students learn", "in a school"),
    ("A doctor", "looks after people who are ill", "in a hospital or a clinic"),
    ("A farmer", "grows crops and raises animals", "on a farm"),
    ("A baker", "makes bread and cakes", "in a bakery"),
    ("A pilot", "flies aeroplanes", "in the cockpit"),
    ("A carpenter", "builds things from wood", "in a workshop"),
    ("A nurse", "cares for patients", "in a hospital"),
    ("A fire fighter", "puts out fires and rescues people", "from a fire station"),
)
JOB_PATTERNS = ("{0} {1}. Most of the work happens {2}.", "{0} works {2} and {1}.")
SCIENCE = (
    "Sound travels through the air as waves, and it moves faster through water than through air.",
    "A magnet has a north pole and a south pole; opposite poles pull towards each other.",
    "Plants take in carbon dioxide and give out oxygen when light falls on their leaves.",
    "The Earth turns once on its axis every day, which gives us day and night.",
    "Metals such as copper carry electricity well, which is why wires are made from them.",
    "A thermometer measures how hot or cold something is.",
    "Light travels in straight lines, and a shadow forms where an object blocks it.",
    "Salt dissolves in water, and the water tastes salty afterwards.",
)


def mc_records(rng: random.Random) -> list[dict]:
    out = []
    for number, (question, right, wrong) in enumerate(QUESTIONS):
        choices = [right, *wrong]
        rng.shuffle(choices)
        out.append({"id": f"mc-{number:03d}", "question": question, "choices": choices, "answer": choices.index(right)})
    return out


def replay_records(rng: random.Random, count: int = 240) -> list[dict]:
    """`count` short documents, each two to four sentences drawn from the replay tables."""
    sentences = [p.format(*row) for row in COUNTRIES for p in COUNTRY_PATTERNS]
    sentences += [p.format(*row) for row in FOODS for p in FOOD_PATTERNS]
    sentences += [p.format(*row) for row in JOBS for p in JOB_PATTERNS]
    sentences += list(SCIENCE)
    sentences = [s[0].upper() + s[1:] for s in sentences]
    return [{"text": " ".join(rng.sample(sentences, rng.randint(2, 4)))} for _ in range(count)]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(HERE), help="folder to write into (default: beside this script)")
    out = Path(parser.parse_args(argv).out)
    rng = random.Random(SEED)
    write_jsonl(out / "tasks" / "general_mc.jsonl", mc_records(rng))
    write_jsonl(out / "tasks" / "general_text.jsonl", [{"text": text} for text in HELD_OUT])
    write_jsonl(out / "train.jsonl", replay_records(rng))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
