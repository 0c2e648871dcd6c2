"""One switch that caps the CPU instruction set torch, oneDNN and MKL use: `RELAY_CPU_ISA`.

    RELAY_CPU_ISA=avx2 bash run_scripts/test.sh          # the suite as on an AVX2-only CPU
    .venv/bin/python bench/isa.py avx2 -- COMMAND ...     # any command, checked and reported

Three libraries pick their kernels from the CPU each on its own; capping one alone measures a
machine that exists nowhere. Each reads its variable once, at its first use (ATen at the first
tensor op, MKL at its first call, oneDNN at its first primitive), so the variables must be in the
environment before the process computes anything: `apply` runs at the top of `pipeline/__init__`
and `tests/conftest.py` (before torch is imported), and `bench/isa.py` sets them for a command's
whole process tree. Imports nothing heavy (no torch).
"""

from __future__ import annotations

import os
from typing import MutableMapping

ISA_ENV: dict[str, dict[str, str]] = {
    # The AVX2-only CPU of most laptops and many cloud VMs (AMD Zen 1-3, Intel before Skylake-SP).
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    # AVX-512 without AMX or the bf16/fp16 extensions (Skylake-SP .. Ice Lake, AMD Zen 4 in fp32).
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    # Whatever the CPU has (the default: nothing is set).
    "native": {},
}
"""Per cap name, the variables that cap ATen's dispatch, oneDNN's JIT and MKL's code path."""


def isa_env(name: str) -> dict[str, str]:
    """The environment variables that cap the three libraries to `name` (a key of ISA_ENV).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    key = name.strip().lower()
    if key not in ISA_ENV:
        raise ValueError(f"RELAY_CPU_ISA={name!r} is not a known cap; known: {', '.join(ISA_ENV)}")
    return dict(ISA_ENV[key])


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the variables of $RELAY_CPU_ISA in `environ` (a variable set by hand is kept) and return
    what was set; nothing without RELAY_CPU_ISA. Too late to take effect in a process that has
    already run a tensor op: call it before importing torch.

    Raises:
        ValueError: RELAY_CPU_ISA names no known cap.
    """
    name = environ.get("RELAY_CPU_ISA", "")
    if not name:
        return {}
    wanted = isa_env(name)
    for key, value in wanted.items():
        environ.setdefault(key, value)
    return wanted
