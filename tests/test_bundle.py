"""The offline bundle (`relay bundle`), its install into an existing torch, and the GPU check's
dry run (CI's stand-in for the GPU run), all on synthetic wheels: nothing is downloaded."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu, gpu_report
from pipeline.tools import bundle, compat

ROOT = Path(__file__).resolve().parents[1]


def make_wheel(folder: Path, name: str, version: str = "1.0", requires: tuple[str, ...] = ()) -> Path:
    """A minimal, installable pure-Python wheel `name` whose module records its own name."""
    module, dist = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}"
    files = {
        f"{module}/__init__.py": f"NAME = {name!r}\n",
        f"{dist}.dist-info/METADATA": "Metadata-Version: 2.1\n"
        + f"Name: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = (
        "".join(
            f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
            f"{len(text.encode())}\n"
            for path, text in files.items()
        )
        + f"{dist}.dist-info/RECORD,,\n"
    )
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in {**files, f"{dist}.dist-info/RECORD": record}.items():
            zf.writestr(member, text)
    return path


@pytest.fixture
def offline_fetch(tmp_path, monkeypatch):
    """bundle.fetch served from a local wheelhouse of synthetic wheels (which the test fills)."""
    house = tmp_path / "wheelhouse"
    house.mkdir()

    def fetch(requirement, name, out, python_version):
        source = next(house.glob(f"{name.replace('-', '_')}-*.whl"))
        target = out / source.name
        target.write_bytes(source.read_bytes())
        return target

    monkeypatch.setattr(bundle, "fetch", fetch)
    return house


@pytest.fixture
def synthetic_bundle(tmp_path, offline_fetch):
    """A complete bundle of synthetic wheels for every need (one with a dependency); version 99.0
    passes every floor of pipeline/tools/compat.py."""
    for name in bundle.NEEDS + bundle.EVAL_NEEDS + bundle.DEV_NEEDS:
        make_wheel(offline_fetch, name, "99.0", requires=("hjson>=3",) if name == "deepspeed" else ())
    make_wheel(offline_fetch, "hjson", "3.1.0")
    out = tmp_path / "bundle"
    bundle.build(out)
    return out


def test_closure_follows_markers_and_extras_and_skips_what_the_image_has(tmp_path, offline_fetch):
    make_wheel(
        offline_fetch,
        "pkg-a",
        requires=("pkg-b[fast]>=1", "numpy>=1", "old-thing; python_version < '3.0'", "tool-x; extra == 'cli'"),
    )
    make_wheel(offline_fetch, "pkg-b", requires=("speedup; extra == 'fast'", "windows-only; sys_platform == 'win32'"))
    make_wheel(offline_fetch, "speedup")
    manifest = bundle.build(tmp_path / "out", needs=("pkg-a",))
    assert [(w["name"], w["required_by"]) for w in manifest["wheels"]] == [
        ("pkg-a", ["relay"]),
        ("pkg-b", ["pkg-a"]),
        ("speedup", ["pkg-b"]),
    ]
    assert manifest["provided_by_image"] == {"numpy": ["pkg-a"]}
    assert bundle.check(tmp_path / "out", needs=("pkg-a",)) == []


def test_a_bundle_never_carries_the_nodes_own_stack(tmp_path, offline_fetch):
    make_wheel(offline_fetch, "pkg-a", requires=("torch>=2",))
    with pytest.raises(bundle.BundleError, match="pkg-a needs torch, which the node's own stack must provide"):
        bundle.build(tmp_path / "out", needs=("pkg-a",), image_has=frozenset())


def test_check_reports_a_missing_need_a_changed_file_and_the_budget(synthetic_bundle):
    assert bundle.check(synthetic_bundle, budget_mib=56) == []
    trl = next(synthetic_bundle.glob("trl-*.whl"))
    trl.write_bytes(trl.read_bytes() + b"x")
    next(synthetic_bundle.glob("gguf-*.whl")).unlink()
    problems = bundle.check(synthetic_bundle, budget_mib=1e-3)
    assert any(p.endswith("size or sha256 differs from bundle.json") and "trl-99.0" in p for p in problems)
    assert any("gguf-99.0-py3-none-any.whl: missing (gguf 99.0)" in p for p in problems)
    assert any("over the budget of 0.001 MiB" in p for p in problems)


def test_a_bundle_without_the_eval_extra_says_so_and_is_complete_without_it(tmp_path, offline_fetch):
    """`--without-eval` (a transfer with a size limit): the manifest records what it leaves out, and
    only such a bundle passes its check without lm-eval."""
    for name in bundle.NEEDS + bundle.DEV_NEEDS:
        make_wheel(offline_fetch, name, "99.0", requires=("hjson>=3",) if name == "deepspeed" else ())
    make_wheel(offline_fetch, "hjson", "3.1.0")
    out = tmp_path / "bundle"
    assert bundle.main(["--out", str(out), "--without-eval"]) == 0
    manifest = json.loads((out / "bundle.json").read_text())
    assert manifest["without"] == ["eval"] and "lm-eval" not in {w["name"] for w in manifest["wheels"]}
    assert bundle.check(out) == []
    (out / "bundle.json").write_text(json.dumps({**manifest, "without": []}))
    assert any("lm-eval is needed but not in the bundle" in p for p in bundle.check(out))


def test_the_command_line_caps_the_size_only_when_asked(synthetic_bundle, monkeypatch):
    """A wheelhouse for an air-gapped cluster may be any size: --budget-mib is a limit only when given."""
    budgets, check = [], bundle.check
    monkeypatch.setattr(
        bundle, "check", lambda folder, budget_mib=None: budgets.append(budget_mib) or check(folder, budget_mib)
    )
    assert bundle.main(["--check", str(synthetic_bundle)]) == 0
    assert bundle.main(["--check", str(synthetic_bundle), "--budget-mib", "0.001"]) == 1
    assert budgets == [None, 0.001]


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
    )


def test_gpu_check_dry_run_lists_everything_and_checks_the_bundle(synthetic_bundle, tmp_path):
    done = run_script("run_scripts/gpu_check.sh", str(tmp_path / "out"), "--bundle", str(synthetic_bundle), "--dry-run")
    assert done.returncode == 0, done.stderr
    for args, _ in gpu.GPU_TESTS:
        assert f"pytest {args}" in done.stdout
    assert f"dry run OK: bundle {synthetic_bundle} complete" in done.stdout
    next(synthetic_bundle.glob("datasets-*.whl")).unlink()
    done = run_script("run_scripts/gpu_check.sh", str(tmp_path / "out"), "--bundle", str(synthetic_bundle), "--dry-run")
    assert done.returncode == 1 and re.search(r"error: .*datasets-99\.0-py3-none-any\.whl: missing", done.stderr), (
        done.stderr
    )
    assert run_script("run_scripts/gpu_check.sh", "--dry-run").returncode == 2  # no OUTDIR: the usage line


def test_install_from_a_bundle_keeps_torch_and_puts_the_wheels_in_the_target(synthetic_bundle, tmp_path):
    site = tmp_path / "site"
    done = run_script("run_scripts/install.sh", "--bundle", str(synthetic_bundle), "--target", str(site))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (site / "draccus" / "__init__.py").read_text() == "NAME = 'draccus'\n"  # the bundle's, not the venv's
    assert "relay runs on: torch " in done.stdout  # compat: one line of versions after the install
    next(synthetic_bundle.glob("trl-*.whl")).unlink()
    done = run_script("run_scripts/install.sh", "--bundle", str(synthetic_bundle), "--target", str(tmp_path / "site2"))
    assert done.returncode == 1 and "is not a complete bundle" in done.stderr


def test_compat_floors_are_pyprojects():
    text = (ROOT / "pyproject.toml").read_text()
    floors = dict(re.findall(r'"([a-z]+)>=([0-9.]+)"', text))
    assert {k: floors[k] for k in compat.FLOORS} == compat.FLOORS


def test_report_lists_two_gpu_tests_as_not_run(tmp_path):
    junit = tmp_path / "t.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_x" name="test_a" time="1.5"/>'
        '<testcase classname="tests.test_x" name="test_b" time="0"><skipped message="GPU-only: FSDP runs only on CUDA '
        'through accelerate, and two ranks need two GPUs (NCCL cannot put two ranks on one)"/></testcase>'
        '<testcase classname="tests.test_x" name="test_c" time="2"><failure message="AssertionError: 1 != 2"/>'
        "</testcase></testsuite></testsuites>"
    )
    assert gpu_report.test_outcomes(junit) == [
        ("tests/test_x.py::test_a", "passed", 1.5),
        ("tests/test_x.py::test_b", "not run: needs 2 GPUs", 0.0),
        ("tests/test_x.py::test_c", "FAILED: AssertionError: 1 != 2", 2.0),
    ]
    text = gpu_report.report([str(junit)], None, None, "NVIDIA H100 80GB HBM3")
    assert "NVIDIA H100 80GB HBM3" in text and "1 passed, 1 failed, 1 not run (need 2 GPUs), 0 skipped" in text


def test_mfu_inputs():
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA H200") == 989.0 and gpu.peak_tflops("Some CPU") is None
    shape = gpu.SHAPES["qwen2.5-0.5b"]
    assert gpu.flops_per_token(shape, 494_032_768, 2048, "full") == 6 * 494_032_768 + 12 * 24 * 896 * 2048
    assert gpu.flops_per_token(shape, 10, 2048, "lora") == 40 + 12 * 24 * 896 * 2048


def test_report_gives_the_decode_table():
    row = {
        "batch": 8,
        "new_tokens": 128,
        "relay-graph": 900.0,
        "relay-eager": 300.0,
        "generate-dynamic": 250.0,
        "generate-static": 400.0,
    }
    lines = gpu_report.bench_section({"shape": "qwen2.5-0.5b", "generate": {"rows": [row], "dtype": "bfloat16"}})
    assert "| 8 | 900 | 300 | 250 | 400 | 3.60x |" in lines
    assert gpu_report.bench_section({"shape": "x", "generate": {"error": "boom"}})[-1] == "- Decoding: error: boom"
