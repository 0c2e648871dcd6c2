"""The suite's disk use stays bounded: a run writes many model folders in all, and a disk that
fills mid-run fails the run with errors that name no cause. pyproject.toml's pytest settings remove a
passing test's `tmp_path` as soon as it ends (and a passing run's whole base folder at its end), so
only module- and session-wide folders live until the run ends (bench/RESULTS.md has the peak)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

LEFT: list[Path] = []


def test_a_passing_test_writes_into_its_folder(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 4096)
    LEFT.append(tmp_path)


def test_the_folder_of_the_passing_test_before_is_gone():
    assert LEFT, "runs after the test above, in the same process"
    assert not LEFT[0].exists(), f"{LEFT[0]} outlived its passing test"


INNER_CONFTEST = """
import importlib.util

spec = importlib.util.spec_from_file_location("relay_conftest", {path!r})
relay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(relay)
module_folder = relay.module_folder
"""
INNER_MODULE = """
from pathlib import Path


def test_writes(module_folder):
    (module_folder / "run").mkdir()
    Path({record!r}).write_text(str(module_folder))


def test_second(module_folder):
    assert (module_folder / "run").is_dir()  # shared by the module's tests
    assert {passes}
"""


@pytest.mark.parametrize("passes", [True, False])
def test_a_module_folder_goes_when_its_module_passes_and_stays_when_it_fails(pytester, tmp_path, passes):
    """tests/conftest.py `module_folder`: the module's tests share it; it is removed at the module's end
    when none of them failed, and kept (for the failure's evidence) when one did."""
    record = tmp_path / "folder.txt"
    pytester.makeconftest(INNER_CONFTEST.format(path=str(Path(__file__).with_name("conftest.py"))))
    pytester.makepyfile(test_inner=INNER_MODULE.format(record=str(record), passes=passes))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-o", "tmp_path_retention_policy=all")
    result.assert_outcomes(passed=2 if passes else 1, failed=0 if passes else 1)
    assert Path(record.read_text()).exists() is not passes
