"""What docs/install.md promises of an install: where Relay finds vLLM's environment, what the
offline bundle carries, and which extras the documented installs name (pyproject.toml and
run_scripts/install.sh are the references)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement

from pipeline.modeling import vllm_server
from pipeline.tools import bundle

ROOT = Path(__file__).resolve().parents[1]
INSTALL_MD = (ROOT / "docs" / "install.md").read_text()


def fake_venv(folder: Path, installed: bool) -> Path:
    """A virtualenv folder as install_vllm.sh leaves it: bin/python, and its stamp once finished."""
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    if installed:
        (folder / ".relay-installed").write_text("done\n")
    return python


def test_relay_finds_vllm_where_relay_vllm_venv_put_it(tmp_path, monkeypatch):
    """install.md: RELAY_VLLM_VENV is where install_vllm.sh makes, and Relay finds, vLLM's
    environment; Relay looked only at bench/.venv-vllm (run_scripts/test.sh alone mapped it)."""
    monkeypatch.delenv("RELAY_VLLM_PYTHON", raising=False)
    python = fake_venv(tmp_path / "side", installed=True)
    monkeypatch.setenv("RELAY_VLLM_VENV", str(tmp_path / "side"))
    assert vllm_server.vllm_python() == str(python)
    half_made = fake_venv(tmp_path / "half", installed=False)  # install_vllm.sh has not finished there
    monkeypatch.setenv("RELAY_VLLM_VENV", str(tmp_path / "half"))
    assert vllm_server.vllm_python() != str(half_made)
    monkeypatch.setenv("RELAY_VLLM_PYTHON", "/opt/vllm/bin/python")  # an interpreter named outright wins
    assert vllm_server.vllm_python() == "/opt/vllm/bin/python"


def pyproject_requirements(*extras: str) -> list[str]:
    """pyproject.toml's dependencies and the named extras' requirements (read without tomllib, which
    Python 3.10 lacks)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    out = re.findall(r'^\s*"([^"]+)"', block, re.M)
    for extra in extras:
        out += re.findall(r'"([^"]+)"', re.search(rf"^{extra} = \[(.*)\]$", text, re.M).group(1))
    return out


def test_the_bundle_carries_every_dependency_and_the_eval_extra_the_image_lacks():
    """A node installed from `relay bundle` refused configs/demo.yaml ("gold.benchmarks:
    lm-evaluation-harness is not installed"): the bundle lacked the eval extra that install.sh
    installs, and fastapi and uvicorn (`relay serve`), which the image does not have either."""
    wanted = {bundle.canonical(Requirement(r).name) for r in pyproject_requirements("eval")}
    assert wanted - bundle.IMAGE_HAS <= {bundle.canonical(n) for n in bundle.NEEDS + bundle.EVAL_NEEDS}


def test_install_md_names_the_extras_install_sh_installs_and_the_bundle_it_builds():
    """install.md said install.sh runs `pip install -e .[dev]` and its wheelhouse recipe built and
    installed `.[dev]`, without the eval extra (lm-eval) the demo's retention table needs."""
    installed = re.search(r'-e "\.\[([^\]]+)\]"', (ROOT / "run_scripts" / "install.sh").read_text()).group(1)
    documented = re.findall(r"\.\[(dev[^\]]*)\]", INSTALL_MD)
    assert documented and set(documented) == {installed}, documented
    listed = " ".join(re.search(r"The bundle is (.*?), plus every dependency", INSTALL_MD, re.S).group(1).split())
    every = bundle.NEEDS + bundle.EVAL_NEEDS + bundle.DEV_NEEDS
    assert sorted(re.findall(r"[\w-]+", listed.replace(" and ", ", "))) == sorted(every)
