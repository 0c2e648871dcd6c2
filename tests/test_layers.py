"""ARCHITECTURE.md's rule for stages: no stage imports (or subclasses) another stage; what two
stages share lives below them (pipeline/algorithms: PolicyStage, ReferenceStage)."""

from __future__ import annotations

import ast
from pathlib import Path

STAGES = Path(__file__).resolve().parents[1] / "stages"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_no_stage_imports_another_stage():
    offenders = {
        path.name: sorted(m for m in imported_modules(path) if m == "stages" or m.startswith("stages."))
        for path in sorted(STAGES.glob("*.py"))
        if path.name != "__init__.py"
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
