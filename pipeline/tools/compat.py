"""Which versions Relay runs on here: one line per package and one per problem, never a traceback.

    python -m pipeline.tools.compat      # after run_scripts/install.sh --bundle DIR on a node

A node's image brings its own torch, transformers, accelerate and peft (e.g. torch 2.11 + CUDA 13,
transformers 5.17, accelerate 1.15); the bundle brings the rest. Relay's floors are pyproject.toml's;
the packages below are imported, so a broken install shows here rather than in a stage's first step.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import sys
from typing import Optional

FLOORS = {
    "torch": "2.7",
    "transformers": "4.56.2",
    "accelerate": "1.10",
    "peft": "0.17",
    "datasets": "4.7",
    "trl": "1.0",
    "deepspeed": "0.19.3",
    "bitsandbytes": "0.48",
    "draccus": "0.11",
    "gguf": "0.10",
    "safetensors": "0.4",
}
"""pyproject.toml's lower bounds (test_bundle checks the two agree)."""
MODULES = {"pyyaml": "yaml"}


def version_problem(name: str, floor: str) -> tuple[Optional[str], Optional[str]]:
    """(installed version or None, the problem in one line or None)."""
    from packaging.version import Version

    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return None, f"{name}: not installed (Relay needs >= {floor})"
    if Version(version) < Version(floor):
        return version, f"{name}: {version} is older than Relay's floor {floor}"
    try:
        importlib.import_module(MODULES.get(name, name))
    except Exception as err:  # noqa: BLE001 -- any import failure is this package's one line
        return (
            version,
            f"{name}: {version} does not import: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
        )
    return version, None


def main(argv: Optional[list[str]] = None) -> int:
    problems, seen = [], []
    for name, floor in FLOORS.items():
        version, problem = version_problem(name, floor)
        seen.append(f"{name} {version or '-'}")
        if problem:
            problems.append(problem)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    print(f"relay runs on: {', '.join(seen)}; torch CUDA {torch.version.cuda or '-'}, {device}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
