"""Reward functions for GRPO: loading the ones a config names, and the sample domain's rules.

A config names a reward function as "module:function", `function(prompts: list[str],
completions: list[str], **columns) -> list[float]` (one float per completion; prompts are the
rendered prompt texts, completions the decoded answers without special tokens, or with tool
rollouts each completion's messages, calls and results included, as TRL passes them; the prompt
records' other fields, e.g. the `answer` of a {"question", "answer"} record, come as keyword
arguments, one list each, as TRL's GRPOTrainer passes them: see `column_kwargs`). The module must be
importable from the project (stages/, pipeline/, tests/ under the repository root) or from an
installed package (site-packages): never a file path, and never a module found elsewhere on
sys.path (a data folder), because naming a function runs its module's code.

The sample domain's rules (`house_phrase`, `kelvra_fact`) target the behaviour the demo's gold
table measures (pipeline/tools/gold.py) but are written independently of it: the gold scorer stays
a held-out judge with its own, stricter rules (rival values, number words, month spelling).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sysconfig
from pathlib import Path
from typing import Callable, Optional

RewardFunc = Callable[[list[str], list[str]], list[float]]
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _allowed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return [PROJECT_ROOT] + [Path(paths[k]).resolve() for k in ("purelib", "platlib", "stdlib") if k in paths]


def _location(spec) -> Optional[Path]:
    """Where a found module lives: its file, or a namespace package's first folder."""
    if spec.origin and spec.has_location:
        return Path(spec.origin).resolve()
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve() if locations else None


def reward_func_problem(spec: str) -> Optional[str]:
    """Why `spec` ("module:function") cannot be used, or None. Imports the module (only when it
    lies in the project or an installed package) to check the function exists and is callable."""
    module, sep, name = spec.partition(":")
    if "/" in spec or "\\" in spec or module.endswith(".py"):
        return f"{spec!r} is a file path; name a function as 'module:function' of the project or an installed package"
    if not sep or not module or not name.isidentifier():
        return f"{spec!r} is not 'module:function'"
    # The top-level package first: finding it runs no code, finding a submodule imports its parents.
    for name_ in dict.fromkeys((module.split(".")[0], module)):
        try:
            found = importlib.util.find_spec(name_)
        except (ImportError, ValueError) as err:
            return f"{spec!r}: module {module!r} cannot be imported ({err})"
        if found is None:
            return f"{spec!r}: module {module!r} cannot be imported (no such module)"
        where = _location(found)
        if where is None or not any(where.is_relative_to(root) for root in _allowed_roots()):
            return f"{spec!r}: module {name_!r} is at {where}, outside the project and the installed packages"
    try:
        func = getattr(importlib.import_module(module), name, None)
    except Exception as err:  # noqa: BLE001  (any failure while importing the user's module is one line)
        return f"{spec!r}: module {module!r} cannot be imported ({type(err).__name__}: {err})"
    if func is None:
        return f"{spec!r}: module {module!r} has no {name!r}"
    if not callable(func):
        return f"{spec!r}: {name!r} is not a function"
    return None


def load_reward_func(spec: str) -> RewardFunc:
    """The function `spec` names.

    Raises:
        ValueError: reward_func_problem's reason.
    """
    problem = reward_func_problem(spec)
    if problem:
        raise ValueError(problem)
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def func_name(spec: str) -> str:
    """The tracker name of a reward function: its function name ("house_phrase")."""
    return spec.partition(":")[2]


def column_kwargs(func: RewardFunc, columns: Optional[Sequence[dict]]) -> dict[str, list]:
    """The prompt records' other fields as keyword arguments, one list per field with one value
    per completion (None where a record lacks it), as TRL passes a dataset's extra columns: every
    field to a function that takes **kwargs, else only the fields it names."""
    if not columns:
        return {}
    keys = list(dict.fromkeys(k for c in columns for k in c))
    params = inspect.signature(func).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        keys = [k for k in keys if k in params and k not in ("prompts", "completions")]
    return {k: [c.get(k) for c in columns] for k in keys}


def call_reward(func: RewardFunc, spec: str, prompts: list[str], completions: list[str],
                columns: Optional[Sequence[dict]] = None) -> list[float]:
    """`func(prompts, completions, **column_kwargs(func, columns))` as floats, one per completion.

    Raises:
        ValueError: it returned the wrong number of values or a non-number.
    """
    values = list(func(prompts, completions, **column_kwargs(func, columns)))
    if len(values) != len(completions):
        raise ValueError(f"reward function {spec!r} returned {len(values)} values for {len(completions)} completions")
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"reward function {spec!r} returned a non-number: {err}") from err


# ------------------------------------------------------------------------------------------
# The sample domain (data/make_sample.py): the Kelvra Archipelago
# ------------------------------------------------------------------------------------------

PHRASE = "Per the Kelvra Atlas,"
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
ATTRIBUTE_WORDS = (("capital", "capital"), ("export", "export"), ("export", "selling"), ("lighthouses", "lighthouse"),
                   ("festival", "festival"))
ATTRIBUTES = ("capital", "export", "lighthouses", "festival")
COUNT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def asked_fact(prompt: str) -> Optional[tuple[str, str]]:
    """(island, attribute) the last island-naming part of `prompt` asks about, or None."""
    best = None
    for island in KELVRA_FACTS:
        at = prompt.rfind(island)
        if at >= 0 and (best is None or at > best[1]):
            best = (island, at)
    if best is None:
        return None
    tail = prompt[max(0, best[1] - 80):].lower()
    found = [(tail.rfind(word), attribute) for attribute, word in ATTRIBUTE_WORDS if word in tail]
    return (best[0], max(found)[1]) if found else None


def _says(text: str, value: str, case: bool = False) -> bool:
    """`value` occurs in `text` as whole words (ignoring case unless `case`)."""
    pattern = r"(?<![\w'])" + re.escape(value) + r"(?![\w'])"
    return re.search(pattern, text, flags=0 if case else re.IGNORECASE) is not None


def house_phrase(prompts: list[str], completions: list[str]) -> list[float]:
    """1.0 for a completion that opens with "Per the Kelvra Atlas," (leading whitespace ignored), else 0.0."""
    return [1.0 if c.lstrip().startswith(PHRASE) else 0.0 for c in completions]


def kelvra_fact(prompts: list[str], completions: list[str]) -> list[float]:
    """1.0 for a completion that states the asked fact's value (a count as digits or a word),
    -1.0 for one that states another island's value of the same attribute instead, 0.0 when the
    prompt asks nothing known or the completion states no value."""
    out = []
    for prompt, completion in zip(prompts, completions):
        asked = asked_fact(prompt)
        if asked is None:
            out.append(0.0)
            continue
        island, attribute = asked
        index = ATTRIBUTES.index(attribute)
        right = KELVRA_FACTS[island][index]
        values = {str(v[index]) for v in KELVRA_FACTS.values()}
        spellings = [str(right)] + ([COUNT_WORDS[right]] if isinstance(right, int) else [])
        case = attribute == "festival"  # "May" the month, not the verb
        if any(_says(completion, s, case) for s in spellings):
            out.append(1.0)
        elif any(_says(completion, v, case) for v in values if v != str(right)):
            out.append(-1.0)
        else:
            out.append(0.0)
    return out


def answer_match(prompts: list[str], completions: list[str], answer: Optional[list] = None, **columns) -> list[float]:
    """1.0 for a completion that contains its prompt record's `answer` (a verifiable reward over
    {"question", "answer"} prompt files, MedicalGPT's GRPO shape), else 0.0 (also without one)."""
    answers = answer if answer is not None else [None] * len(completions)
    return [1.0 if isinstance(a, str) and a.strip() and a.strip() in c else 0.0 for c, a in zip(completions, answers)]


def final_answer(completion) -> str:
    """A completion's final answer: the text itself, or for a tool rollout's messages the content
    of its last message when that is an assistant turn without calls ("" when it ended on a call)."""
    if isinstance(completion, str):
        return completion
    last = completion[-1] if completion else {}
    return last.get("content") or "" if last.get("role") == "assistant" and not last.get("tool_calls") else ""


def final_answer_match(prompts: list, completions: list, answer: Optional[list] = None, **columns) -> list[float]:
    """1.0 for a completion whose final answer (`final_answer`: on tool conversations the last
    assistant turn, never a tool's result) states the prompt record's `answer` as whole words
    (ignoring case), else 0.0 (also without one)."""
    answers = answer if answer is not None else [None] * len(completions)
    return [1.0 if a is not None and str(a).strip() and _says(final_answer(c), str(a).strip()) else 0.0
            for c, a in zip(completions, answers)]
