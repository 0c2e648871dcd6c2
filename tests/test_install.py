"""run_scripts/install.sh once the environment is installed (its stamp matches): it still compiles
Relay's own modules to bytecode, also where PYTHONDONTWRITEBYTECODE keeps Python from writing it,
so that no stage, driver or test process compiles them from source again; the side environments
under bench/ are left alone."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_installed_tree_gets_its_own_modules_compiled_and_not_the_side_environments(tmp_path):
    (tmp_path / "run_scripts").mkdir()
    shutil.copy(ROOT / "run_scripts" / "install.sh", tmp_path / "run_scripts" / "install.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    stamp = subprocess.run(
        "sha256sum pyproject.toml run_scripts/install.sh | sha256sum | cut -d' ' -f1",
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (tmp_path / ".venv" / ".relay-installed").write_text(stamp)  # installed: install.sh takes its quick path
    ours = [
        tmp_path / p
        for p in (
            "pipeline/a.py",
            "stages/b.py",
            "data_formats/c.py",
            "bench/d.py",
            "bench/comparisons/e.py",
            "tests/f.py",
        )
    ]
    side = tmp_path / "bench" / ".venv-side" / "lib" / "g.py"
    for path in [*ours, side]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("X = 1\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        ["bash", "run_scripts/install.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert [p.name for p in ours if not Path(importlib.util.cache_from_source(str(p))).is_file()] == []
    assert not Path(importlib.util.cache_from_source(str(side))).exists()
