"""The version gates, with the versions faked: a torch whose FSDP2 lacks what pipeline/engine/fsdp.py
uses is refused in one line among the config problems (before any model loads), and a package
below pyproject's floor is named by `python -m pipeline.tools.compat`. The floors themselves are
checked on the lowest versions by run_scripts/check_versions.sh (a separate CPU job)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipeline.tools import compat

ROOT = Path(__file__).resolve().parents[1]


def test_fsdp_on_a_torch_without_fsdp2s_api_is_a_config_problem(tiny_model_dir, monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from pipeline.config import load_config
    from pipeline.engine.accelerator import combination_problems
    from stages.sft import SFTConfig

    cfg = load_config(SFTConfig, ["--model.path", str(tiny_model_dir), "--distributed.engine", "fsdp"])
    assert combination_problems(cfg) == []
    monkeypatch.delattr(FSDPModule, "set_reshard_after_forward")  # as torch before 2.8
    assert combination_problems(cfg) == [
        f"distributed.engine: fsdp needs torch 2.8 or newer (FSDPModule.set_reshard_after_forward); "
        f"this is torch {torch.__version__}: upgrade torch, or use distributed.engine ddp"
    ]
    cfg.distributed.engine = "ddp"
    assert combination_problems(cfg) == []


@pytest.mark.parametrize(
    "name,installed", [("torch", "2.6.0"), ("transformers", "4.56.1"), ("datasets", "3.0.0"), ("deepspeed", "0.19.2")]
)
def test_a_package_below_its_floor_is_named_in_one_line(name, installed, monkeypatch):
    real = compat.metadata.version
    monkeypatch.setattr(compat.metadata, "version", lambda n: installed if n == name else real(n))
    floor = compat.FLOORS[name]
    assert compat.version_problem(name, floor) == (
        installed,
        f"{name}: {installed} is older than Relay's floor {floor}",
    )


def test_the_version_job_pins_floors_that_pyproject_declares():
    """check_versions.sh installs `NAME==floor` for these names, read from pyproject.toml."""
    script = (ROOT / "run_scripts" / "check_versions.sh").read_text()
    pinned = re.search(r'^pinned="([^"]+)"', script, re.M).group(1).split()
    assert set(pinned) <= set(compat.FLOORS) and {"torch", "transformers", "accelerate", "peft"} <= set(pinned)
