"""Tools for the sample domain (the Kelvra Archipelago, data/make_sample.py), for tool rollouts
(`tools.funcs: [pipeline.algorithms.sample_tools:kelvra_lookup]`) and `relay chat --tools`. Each is
a pure function with type hints and a Google-style docstring, from which its schema is read
(pipeline/algorithms/tool_rollout.py)."""

from __future__ import annotations

from pipeline.algorithms.rewards import ATTRIBUTES, KELVRA_FACTS


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
