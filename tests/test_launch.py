"""`python -m pipeline.engine.launch` (torchrun with one line on early ends) leaves no folder of
torchrun's in TMPDIR: without `--log-dir` torchrun makes a `torchelastic_*` folder of empty per-rank
folders at every launch and never removes it. Two plain ranks (no torch in them), one run that ends
well and one whose rank 1 fails; each keeps the exit code torchrun's workers gave."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "pipeline.engine.launch", "--standalone", "--nproc_per_node", "2"]
"""What `relay train --nproc 2` runs before the stage's script (tests/test_cli.py)."""
SCRIPT = "import os, sys; sys.exit(int(os.environ['RANK']) * int(sys.argv[1]))"


@pytest.mark.parametrize("code", [0, 3])
def test_a_launch_leaves_nothing_in_tmpdir(tmp_path, code):
    script, tmp = tmp_path / "rank.py", tmp_path / "tmp"
    script.write_text(SCRIPT)
    tmp.mkdir()
    done = subprocess.run(
        [*LAUNCH, str(script), str(code)],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == code, done.stderr[-2000:]
    assert ("launch: rank 1 ended first (exit code 3)" in done.stderr) == (code == 3)
    assert "failed (exitcode" not in done.stderr  # torchrun's own line for it, once more: not printed
    assert os.listdir(tmp) == []


def test_a_log_folder_holding_a_file_is_kept(tmp_path):
    from pipeline.engine.launch import remove_if_no_file

    empty, kept = tmp_path / "empty" / "run_1" / "attempt_0" / "0", tmp_path / "kept" / "run_1" / "attempt_0" / "0"
    empty.mkdir(parents=True)
    kept.mkdir(parents=True)
    (kept / "error.json").write_text("{}")
    remove_if_no_file(str(tmp_path / "empty"))
    remove_if_no_file(str(tmp_path / "kept"))
    assert sorted(os.listdir(tmp_path)) == ["kept"]
