"""The install and test scripts. run_scripts/install.sh once the environment is installed (its stamp
matches): it still compiles Relay's own modules to bytecode, also where PYTHONDONTWRITEBYTECODE keeps
Python from writing it, so that no stage, driver or test process compiles them from source again;
the side environments under bench/ are left alone. run_scripts/test.sh (with stub installs, linter
and interpreter): the run's temporary folder, vLLM's side install started first and stopped with the
run, pytest allowed to keep its rewritten test modules; and tests/conftest.py's imports skipped in
pytest-xdist's controller."""

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


def fake_test_tree(tmp_path: Path, python_exit: int) -> Path:
    """A copy of run_scripts/test.sh whose install, linter and interpreter are stubs: the stub
    interpreter (pytest) writes a file where `tempfile` puts temporary files and exits `python_exit`."""
    tree = tmp_path / "tree"
    (tree / "run_scripts").mkdir(parents=True)
    shutil.copy(ROOT / "run_scripts" / "test.sh", tree / "run_scripts" / "test.sh")
    (tree / "run_scripts" / "install.sh").write_text("exit 0\n")
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "ruff").write_text("#!/bin/sh\nexit 0\n")
    (tree / ".venv" / "bin" / "python").write_text(
        f"#!/bin/sh\n{sys.executable} -c 'import tempfile; open(tempfile.mkstemp()[1], \"w\")'\nexit {python_exit}\n"
    )
    for stub in ("ruff", "python"):
        (tree / ".venv" / "bin" / stub).chmod(0o755)
    return tree


def test_the_suites_temporary_files_go_into_one_folder_removed_when_the_run_passes(tmp_path):
    """run_scripts/test.sh gives the run a TMPDIR of its own inside the caller's: a passing run leaves
    nothing behind; a failing one keeps the folder and names it."""
    outer = tmp_path / "tmp"
    outer.mkdir()
    env = {**os.environ, "TMPDIR": str(outer), "RELAY_VLLM_INSTALL": "0", "RELAY_TEST_WORKERS": "1"}
    passed = subprocess.run(["bash", "run_scripts/test.sh"], cwd=fake_test_tree(tmp_path / "a", 0), env=env)
    assert passed.returncode == 0 and list(outer.iterdir()) == []
    failed = subprocess.run(
        ["bash", "run_scripts/test.sh"], cwd=fake_test_tree(tmp_path / "b", 1), env=env, capture_output=True, text=True
    )
    (kept,) = outer.iterdir()
    assert failed.returncode == 1 and kept.name.startswith("relay-tests.") and len(list(kept.iterdir())) == 1
    assert f"temporary files are in {kept}" in failed.stderr


def test_vllms_install_starts_before_relays_and_stops_with_the_run(tmp_path):
    """run_scripts/test.sh starts the vLLM side environment's install first, so that it runs beside
    Relay's own install (mostly one core) rather than beside the tests; a run that ends first stops
    it, and a failed install of Relay's names the run's temporary folder too."""
    outer = tmp_path / "tmp"
    outer.mkdir()
    env = {**os.environ, "TMPDIR": str(outer), "RELAY_VLLM_INSTALL": "1", "RELAY_TEST_WORKERS": "1"}
    env.pop("RELAY_VLLM_VENV", None)
    for name, install_exit in (("a", 0), ("b", 1)):
        tree = fake_test_tree(tmp_path / name, 0)
        started, pid = tree / "vllm-started", tree / "vllm-pid"
        # the side install: says it started, then would run for a minute
        (tree / "run_scripts" / "install_vllm.sh").write_text(f"echo $$ > {pid}\ntouch {started}\nsleep 60\n")
        # Relay's install: waits (up to 10 s) for the side install to have started
        (tree / "run_scripts" / "install.sh").write_text(
            f"for i in $(seq 100); do [ -f {started} ] && exit {install_exit}; sleep 0.1; done\nexit 7\n"
        )
        done = subprocess.run(["bash", "run_scripts/test.sh"], cwd=tree, env=env, capture_output=True, text=True)
        assert done.returncode == install_exit, done.stderr
        side = int(pid.read_text())
        for _ in range(50):  # the kill is sent as the run ends; the process goes within moments
            if not Path(f"/proc/{side}").exists():
                break
            subprocess.run(["sleep", "0.1"])
        assert not Path(f"/proc/{side}").exists()
        if install_exit:
            (kept,) = outer.iterdir()
            assert f"temporary files are in {kept}" in done.stderr
        else:
            assert list(outer.iterdir()) == []


def test_pytest_may_keep_its_rewritten_test_modules_where_the_caller_forbids_bytecode(tmp_path):
    """pytest writes its assertion-rewritten test modules as bytecode only where Python may write
    bytecode; run_scripts/test.sh lets it (and the run's processes) write, also under a caller's
    PYTHONDONTWRITEBYTECODE, so that no worker rewrites every test module again at every run."""
    tree = fake_test_tree(tmp_path, 0)
    seen = tmp_path / "seen"
    (tree / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\necho "[$PYTHONDONTWRITEBYTECODE]" > {seen}\n')
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "RELAY_VLLM_INSTALL": "0", "RELAY_TEST_WORKERS": "1"}
    done = subprocess.run(["bash", "run_scripts/test.sh"], cwd=tree, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert seen.read_text().strip() == "[]"


def test_xdists_controller_loads_the_tests_conftest_without_torch():
    """pytest-xdist's controller runs no test: loading tests/conftest.py there imports neither torch
    nor transformers (seconds before the workers start); a process that runs tests imports them in
    `pytest_configure`."""
    code = (
        "import sys, types; sys.path.insert(0, 'tests'); import conftest; "
        "heavy = sorted(m for m in ('torch', 'transformers', 'bitsandbytes') if m in sys.modules); "
        "option = lambda n: types.SimpleNamespace(getoption=lambda name, default=None: n); "
        "print(heavy, conftest.xdist_controller(option(2)), conftest.xdist_controller(option(None))); "
        # pytest_configure with stand-ins for the heavy modules: the controller imports none, a
        # process that runs tests imports all three and sets torch's threads to the worker's share
        "threads = []; "
        "fakes = {m: types.ModuleType(m) for m in ('torch', 'bitsandbytes', 'tinymodels')}; "
        "fakes['torch'].set_num_threads = threads.append; "
        "sys.meta_path.insert(0, types.SimpleNamespace(find_spec=lambda name, path=None, target=None: "
        "(_ for _ in ()).throw(AssertionError(name)) if name in fakes else None)); "
        "conftest.pytest_configure(option(2)); "
        "sys.meta_path.pop(0); sys.modules.update(fakes); "
        "conftest.pytest_configure(option(None)); "
        "print(threads == [conftest._THREADS])"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "True", "False", "True"]
