"""The record format registry (data_formats/formats) and the layout of data_formats: every layout
is one registry entry whose `detect` answers from a record's keys; the common types' module imports
no family; no import circle and no private name crosses a file; the token cache's code hash sees
every family module."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from data_formats import formats, token_cache
from data_formats.formats import NAMES, REGISTRY, detect_format, kind_formats
from data_formats.sources import summarize
from data_formats.validate import read_and_parse

PACKAGE = Path(__file__).resolve().parent.parent / "data_formats"

# One record per auto-detected format: the format `detect_format` must give it.
EXAMPLES = {
    "chatml": {"chat_rounds": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    "messages": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    "sharegpt": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    "alpaca": {"instruction": "q", "output": "a"},
    "pair": {"question": "q", "answer": "a"},
    "firefly": {"conversation": [{"human": "q", "assistant": "a"}]},
    "prompt_completion": {"prompt": "q", "completion": "a"},
    "preference": {"prompt": "q", "chosen": "a", "rejected": "b"},
    "prompt": {"prompt": "q"},
    "text": {"text": "a document"},
}


def test_every_format_name_has_an_auto_detected_entry_and_every_entry_a_known_name():
    auto = {e.name for e in REGISTRY if e.auto and not e.refusal}
    assert auto == set(NAMES) == set(EXAMPLES)
    for entry in REGISTRY:
        assert entry.refusal or entry.name in NAMES + (formats.UNPAIRED,), entry
        assert entry.turns is None or entry.pair is None, f"{entry.name}: one reader"
        assert (entry.turns or entry.pair) or entry.refusal or entry.kinds == ("pt",), f"{entry.name}: no reader"
        assert entry.kinds or entry.refusal, entry


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_format_is_detected_from_its_keys(name):
    assert detect_format(EXAMPLES[name]) == name


def test_the_formats_of_a_kind_are_listed_in_the_documented_order():
    assert kind_formats("sft") == ("chatml", "messages", "sharegpt", "alpaca", "pair", "firefly", "prompt_completion")
    assert kind_formats("prompts") == kind_formats("sft") + ("prompt",)
    assert kind_formats("rm") == ("preference",) and kind_formats("pt") == ("text",)


def test_every_preference_layout_reads_its_own_records(tmp_path):
    """Each preference entry is the one that reads its records (pair_layout: the first that detects)."""
    hh = "\n\nHuman: q\n\nAssistant: "
    records = {
        "openai": {
            "input": {"messages": [{"role": "user", "content": "q"}]},
            "preferred_output": [{"role": "assistant", "content": "a"}],
            "non_preferred_output": [{"role": "assistant", "content": "b"}],
        },
        "hh": {"chosen": hh + "a", "rejected": hh + "b"},
        "hh_prompt": {"prompt": "\n\nHuman: q", "chosen": "\n\nAssistant: a", "rejected": "\n\nAssistant: b"},
        "medicalgpt": {"question": "q", "response_chosen": "a", "response_rejected": "b"},
        "llamafactory": {
            "chosen_messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected_messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
        },
        "trl": {"prompt": "q", "chosen": "a", "rejected": "b"},
    }
    readers = [e.pair.__module__.rsplit(".", 1)[-1] for e in REGISTRY if e.pair is not None]
    assert readers == ["openai", "hh", "hh", "medicalgpt", "llamafactory", "trl"]
    for name, record in records.items():
        assert detect_format(record) == "preference"
        reader = formats.pair_layout(record).pair
        assert reader.__module__.endswith("." + name.split("_")[0]), name
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(record) + "\n")
        good, problems = read_and_parse([str(path)], "rm")
        assert problems == [], summarize(problems)
        chosen, rejected, _ = good[0].value
        assert [(t.role, t.content) for t in chosen.turns] == [("user", "q"), ("assistant", "a")], name
        assert [(t.role, t.content) for t in rejected.turns] == [("user", "q"), ("assistant", "b")], name


def test_firefly_records_are_prompts_like_any_conversation(tmp_path):
    """A Firefly prompt is its whole conversation up to the last user turn (it used to end in a
    StopIteration traceback, or keep the first turn alone)."""
    path = tmp_path / "firefly.jsonl"
    records = [
        {"conversation": [{"human": "hi"}]},
        {"system": "Be brief.", "conversation": [{"human": "q1", "assistant": "a1"}, {"human": "q2"}], "answer": "4"},
        {"conversation": [{"human": "q", "assistant": "a"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    good, problems = read_and_parse([str(path)], "prompts")
    assert [[(t.role, t.content) for t in g.value.turns] for g in good] == [
        [("user", "hi")],
        [("system", "Be brief."), ("user", "q1"), ("assistant", "a1"), ("user", "q2")],
    ]
    assert good[1].value.meta == {"answer": "4"} and not good[1].value.standard
    assert summarize(problems) == [f"{path}:3: last turn must be the user's, got assistant"]


def test_the_token_cache_code_hash_covers_the_family_modules(tmp_path):
    """A change to a format family's module (in a subpackage) invalidates the token cache."""
    copy = tmp_path / "a" / "data_formats"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = token_cache.code_fingerprint(copy)
    family = copy / "formats" / "hh.py"
    family.write_text(family.read_text() + "\n# changed\n")
    changed = tmp_path / "b" / "data_formats"
    shutil.copytree(copy, changed)
    assert token_cache.code_fingerprint(changed) != before
    assert token_cache.code_fingerprint() == token_cache.code_fingerprint(PACKAGE)


# ------------------------------------------------------------------------------------------
# The layout of data_formats
# ------------------------------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path):
    """(imported module, names, inside a function) for every import of the module at `path`."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(n) for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], id(node) in inside
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            yield base, [a.name for a in node.names], id(node) in inside


# Imports inside functions that stay there: the command lines load a tokenizer through modeling
# (an upward import, the documented exception), and heavy optional libraries load only when used.
FUNCTION_IMPORTS = {
    ("data_formats.validate", "pipeline.config"),
    ("data_formats.validate", "pipeline.modeling.embedded"),
    ("data_formats.validate", "pipeline.modeling.models"),
    ("data_formats.show", "pipeline.config"),
    ("data_formats.show", "pipeline.modeling.embedded"),
    ("data_formats.show", "pipeline.modeling.models"),
    ("data_formats.readers", "datasets"),
    ("data_formats.token_cache", "tokenizers"),
    ("data_formats.token_cache", "transformers"),
}


def test_data_formats_has_no_import_circle_no_private_crossing_and_few_function_imports():
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    crossing, inside = [], []
    for name, path in modules.items():
        for target, names, in_function in _imports(name, path):
            own = {f"{target}.{n}" for n in names if f"{target}.{n}" in modules} | ({target} & modules.keys())
            graph[name] |= own - {name}
            if target.startswith("data_formats"):
                crossing += [f"{name} imports {target}.{n}" for n in names if n.startswith("_") and n != "__future__"]
            if in_function and (name, target) not in FUNCTION_IMPORTS:
                inside.append(f"{name} imports {target} inside a function")
    assert crossing == [] and inside == []

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert [m for m in modules if m in reach(m)] == [], "import circle"
    # The common types' module reads no format; a family module reads no other family but the
    # shared message reader (lists) and TRL's prompt reader (a prompt record's message list).
    assert graph["data_formats.conversation"] == set()
    families = {m for m in modules if m.startswith("data_formats.formats.")}
    shared = {"data_formats.formats.lists", "data_formats.formats.trl"}
    for family in families:
        assert graph[family] & families <= shared, family


def test_no_format_name_dispatch_outside_the_registry():
    """No `fmt == "..."` (or `fmt in (...)`) outside data_formats/formats/__init__.py."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "formats" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id in ("fmt", "found"):
                names = [c.value for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                names += [
                    e.value
                    for c in node.comparators
                    if isinstance(c, ast.Tuple)
                    for e in c.elts
                    if isinstance(e, ast.Constant)
                ]
                if set(names) - {"auto"}:
                    found.append(f"{path.name}:{node.lineno}")
    assert found == []
