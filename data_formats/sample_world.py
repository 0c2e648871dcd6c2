"""The sample domain's world, the Kelvra Archipelago (data/make_sample.py writes the sample data
about it): its facts, which the demo's reward functions check answers against
(pipeline/algorithms/rewards.py), and its tools for tool rollouts and `relay chat --tools`
(`tools.funcs: [data_formats.sample_world:kelvra_lookup]`). A tool is a pure function with type
hints and a Google-style docstring, from which its schema is read
(pipeline/rl/tool_rollout.py)."""

from __future__ import annotations

PHRASE = "Per the Kelvra Atlas,"
"""The house style's opening: a preferred answer starts with it."""
KELVRA_FACTS = {
    # island: (capital, main export, lighthouses, lantern-festival month); the same table as
    # data/make_sample.py ISLANDS (tests/test_grpo.py checks they agree)
    "Oru": ("Tessel", "salt", 3, "March"),
    "Veskel": ("Marrow Bay", "kelp paper", 5, "June"),
    "Tamarin Rock": ("Orlin", "amber", 1, "October"),
    "Lisk": ("Cask", "smoked eel", 4, "January"),
    "Pellago": ("Dunmere", "slate", 7, "August"),
    "Corvane": ("Velo", "copper wire", 2, "May"),
    "Nimbre": ("Pryn", "glass beads", 6, "December"),
    "Quillon": ("Abbot's Cove", "wool", 8, "April"),
    "Sarth": ("Sile", "pearl buttons", 2, "September"),
    "Ebbmoor": ("Rook", "pine tar", 9, "February"),
    "Haldra": ("Tarn", "pear cider", 3, "July"),
    "Fenwick Reach": ("Gale", "hemp rope", 5, "November"),
}
ATTRIBUTE_WORDS = (
    ("capital", "capital"),
    ("export", "export"),
    ("export", "selling"),
    ("lighthouses", "lighthouse"),
    ("festival", "festival"),
)
"""(attribute, a word of a question that asks for it)."""
ATTRIBUTES = ("capital", "export", "lighthouses", "festival")
COUNT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def kelvra_lookup(island: str, attribute: str) -> str:
    """Look up one fact about an island of the Kelvra Archipelago.

    Args:
        island: the island's name, e.g. "Oru"
        attribute: one of "capital", "export", "lighthouses", "festival"
    """
    facts = {name.lower(): values for name, values in KELVRA_FACTS.items()}
    if island.strip().lower() not in facts:
        raise ValueError(f"no island named {island!r}; the islands are {', '.join(KELVRA_FACTS)}")
    if attribute not in ATTRIBUTES:
        raise ValueError(f"attribute must be one of {', '.join(ATTRIBUTES)}")
    return str(facts[island.strip().lower()][ATTRIBUTES.index(attribute)])


def add(a: int, b: int) -> int:
    """Add two integers exactly (numbers too long for a small model to add in its head).

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b
