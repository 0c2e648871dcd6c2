"""The layout ARCHITECTURE.md describes, read from the sources with `ast` (no Relay module is imported
here, so the test loads no torch and runs in well under a second):

- imports run downwards only: `data_formats` and `pipeline.config` <- `pipeline.modeling` <-
  `pipeline.engine` <- `pipeline.algorithms` (pure math) <- `pipeline.rl` (the RL runtime) <- `stages` <-
  `pipeline.tools`, save the EXCEPTIONS
  below, each inside a function and each with its reason;
- no import circle, counting the imports inside functions too (a circle held open by a
  function-level import is still two modules that cannot be read, tested or moved apart);
- the commands that must start without torch (`relay`, the pipeline driver, the report, the config)
  reach no heavy library through their top-level imports;
- imports of Relay's own modules inside functions stay at or below FUNCTION_LEVEL_CEILING: such an
  import is kept only where it holds a heavy or optional backend off a light module's import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_formats", "pipeline", "stages")

LAYERS = {
    "data_formats": 0,
    "pipeline": 0,  # the package itself and pipeline/cpu_isa.py (what the CPU can run, read by every layer)
    "pipeline.config": 0,
    "pipeline.modeling": 1,
    "pipeline.engine": 2,
    "pipeline.algorithms": 3,
    "pipeline.rl": 4,
    "stages": 5,
    "pipeline.tools": 6,
}
"""A module's layer is the one of its longest prefix listed here; an import may go to its own layer or
a lower one."""

EXCEPTIONS = {
    (
        "data_formats.validate",
        "pipeline.modeling.embedded",
    ): "`relay validate --kind` on the command line finds the embedded model's tokenizer",
    (
        "data_formats.validate",
        "pipeline.modeling.models",
    ): "`relay validate --kind` on the command line loads a tokenizer to measure lengths",
    (
        "data_formats.show",
        "pipeline.modeling.embedded",
    ): "`relay show` on the command line finds the embedded model's tokenizer",
    (
        "data_formats.show",
        "pipeline.modeling.models",
    ): "`relay show` on the command line loads a tokenizer to render a conversation",
    (
        "pipeline.config.capabilities",
        "stages",
    ): "the capability table reads the stage registry's facts (each stage's kind and data), data only",
}
"""Upward imports that are allowed, each inside a function: (importing module, imported module) ->
why. An entry no import uses any longer fails the test, so the list stays the truth."""

LIGHT = (
    "pipeline.config",
    "pipeline.tools.cli",
    "pipeline.tools.driver",
    "pipeline.tools.chain",
    "pipeline.tools.chain_config",
    "pipeline.tools.report",
    "pipeline.tools.serve",
    "pipeline.engine.tracking",
    "stages",
)
"""Modules that import without torch: the `relay` command and its config checks, the pipeline
driver (run between stages), the report, `relay serve` (its vLLM backend runs the model in vLLM's
own environment; the transformers backend loads torch when it builds its batcher), and the console
setup the driver's summary calls. Every module of `pipeline.config` is light too."""

HEAVY = ("torch", "transformers", "peft", "deepspeed", "accelerate", "bitsandbytes", "trl", "vllm", "safetensors.torch")
"""Libraries that import torch (or are torch), seconds each: a light module reaches them only inside
a function."""

FUNCTION_LEVEL_CEILING = 34
"""Imports of Relay's own modules written inside functions, at most (one per statement). The rest
hold torch off the light modules above, or a heavy backend off a module whose other users do not
need it; lift an import to the top of its module where neither applies, and lower this number."""


class Import(NamedTuple):
    source: str
    target: str  # a Relay module, or a third-party dotted name
    line: int
    in_function: bool


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(mods: dict[str, Path]) -> list[Import]:
    """Every import each module runs (top-level and inside functions; `if TYPE_CHECKING:` blocks are
    never run and left out), resolved to Relay modules where they name one."""
    found = []
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def targets(node) -> list[str]:
            if isinstance(node, ast.Import):
                return [alias.name for alias in node.names]
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from P import m` runs P and, where m is a module, P.m
            return [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in mods]

        def visit(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _type_checking(child):
                    for rest in child.orelse:
                        visit(rest, in_function)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in targets(child):
                        if target.split(".")[0] in PACKAGES:
                            while target not in mods and "." in target:  # `import a.b.c` of a name inside a.b
                                target = target.rpartition(".")[0]
                        if target != name:
                            found.append(Import(name, target, child.lineno, in_function))
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(), str(path)), False)
    return found


def layer(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    raise KeyError(module)


def circles(mods: dict[str, Path], edges: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    graph = defaultdict(set)
    for edge in edges:
        if edge.target in mods:
            graph[edge.source].add(edge.target)
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in mods:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def heavy_paths(mods: dict[str, Path], edges: list[Import], start: str) -> list[str]:
    """The chains of top-level imports (the importing packages' `__init__` included) by which
    importing `start` loads a HEAVY library; [] when it loads none."""
    top = defaultdict(list)
    for edge in edges:
        if not edge.in_function:
            top[edge.source].append(edge.target)

    def with_parents(module: str) -> list[str]:
        parts = module.split(".")
        return [".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in mods]

    seen, paths, todo = set(), [], [(m, [m]) for m in with_parents(start)]
    while todo:
        module, path = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for target in top[module]:
            if any(target == h or target.startswith(h + ".") for h in HEAVY):
                paths.append(" -> ".join(path + [target]))
            else:
                todo += [(m, path + [m]) for m in with_parents(target) if m not in seen]
    return paths


MODS = modules()
EDGES = imports(MODS)


def _where(edge: Import) -> str:
    return f"{MODS[edge.source].relative_to(ROOT)}:{edge.line}"


def test_every_module_has_a_layer():
    assert [m for m in MODS if not any(m == p or m.startswith(p + ".") for p in LAYERS)] == []


def test_imports_run_downwards_save_the_listed_exceptions():
    upward = [e for e in EDGES if e.target in MODS and layer(e.target) > layer(e.source)]
    unlisted = [
        f"{_where(e)}: {e.source} imports {e.target} (layer {layer(e.target)} > {layer(e.source)})"
        for e in upward
        if (e.source, e.target) not in EXCEPTIONS
    ]
    assert unlisted == []
    at_top = [f"{_where(e)}: {e.source} imports {e.target} at the top" for e in upward if not e.in_function]
    assert at_top == []  # an exception holds inside a function only
    assert sorted(set(EXCEPTIONS) - {(e.source, e.target) for e in upward}) == []  # stale entries


def test_no_import_circle_even_through_imports_inside_functions():
    assert circles(MODS, EDGES) == []


def test_circle_finder_sees_a_circle_closed_inside_a_function():
    a, b, c = "pipeline.modeling.a", "pipeline.modeling.b", "pipeline.modeling.c"
    mods = {a: Path("a.py"), b: Path("b.py"), c: Path("c.py")}
    edges = [Import(a, b, 1, False), Import(b, c, 1, False), Import(c, a, 9, True)]
    assert circles(mods, edges) == [[a, b, c]]
    assert circles(mods, edges[:2]) == []


def test_heavy_paths_follow_top_level_imports_only():
    cli, engine, models = "pipeline.tools.cli", "pipeline.engine.stage", "pipeline.modeling.models"
    mods = {m: Path(f"{m}.py") for m in ("pipeline", "pipeline.tools", cli, engine, models)}
    lazy = [Import(cli, engine, 9, True), Import(engine, models, 1, False), Import(models, "torch", 1, False)]
    assert heavy_paths(mods, lazy, cli) == []
    eager = [lazy[0]._replace(in_function=False), *lazy[1:]]
    assert heavy_paths(mods, eager, cli) == [f"{cli} -> {engine} -> {models} -> torch"]


def test_light_modules_reach_no_heavy_library_at_import():
    light = [m for m in MODS if m in LIGHT or m.startswith("pipeline.config.")]
    assert {m: heavy_paths(MODS, EDGES, m) for m in light if heavy_paths(MODS, EDGES, m)} == {}


def test_light_modules_import_without_torch():
    """The same in a fresh interpreter: no third-party library these import loads torch by itself."""
    code = (
        f"import sys; [__import__(m) for m in {list(LIGHT)!r}]; "
        f"sys.exit(', '.join(h for h in {list(HEAVY)!r} if h in sys.modules) or None)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-800:]


def test_function_level_imports_of_relay_modules_stay_under_the_ceiling():
    statements = {(e.source, e.line) for e in EDGES if e.in_function and e.target in MODS}
    assert len(statements) <= FUNCTION_LEVEL_CEILING
