"""The suite's disk use stays bounded: a run writes many model folders in all, and a disk that
fills mid-run fails the run with errors that name no cause. pyproject.toml's pytest settings remove a
passing test's `tmp_path` as soon as it ends (and a passing run's whole base folder at its end), so
only module- and session-wide folders live until the run ends (bench/RESULTS.md has the peak)."""

from __future__ import annotations

from pathlib import Path

LEFT: list[Path] = []


def test_a_passing_test_writes_into_its_folder(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 4096)
    LEFT.append(tmp_path)


def test_the_folder_of_the_passing_test_before_is_gone():
    assert LEFT, "runs after the test above, in the same process"
    assert not LEFT[0].exists(), f"{LEFT[0]} outlived its passing test"
