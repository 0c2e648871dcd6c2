"""Freed host memory kept in the process instead of handed back to the kernel: `RELAY_HOST_MALLOC`.

glibc's malloc serves every block above its mmap threshold (128 KiB at the start, rising with use to at
most 32 MiB) with a mapping of its own and unmaps it at `free`, and gives the heap's free top back to
the kernel above its trim threshold. A training step allocates and frees the same large tensors every
step (logits, their log-softmax and gradients, the embedding's gradient, activations), so on a CPU
every step faults each of their pages in again and the kernel zero-fills them: a minor page fault per
4 KiB page, dearest in a virtual machine. With `keep` (the default) large blocks come from the heap
(`M_MMAP_MAX` 0) and freed memory stays in the process (`M_TRIM_THRESHOLD` at its maximum): a step's
pages are faulted in once, at the first step. The cost: memory a process has freed is not returned to
the system until the process ends (its peak stays its peak). A thread whose arena cannot hold a block
still gets a mapping of its own (glibc falls back to mmap there). What it paid per CPU kind is in
bench/RESULTS.md.

    RELAY_HOST_MALLOC=keep     # the default: freed memory stays in the process
    RELAY_HOST_MALLOC=system   # glibc's own behaviour

`apply` runs when `pipeline` is imported (pipeline/__init__.py), so every Relay process (stage
scripts and their ranks, the driver with its gold and retention tables, chat, serve, the tools) gets
it; processes Relay starts with another interpreter (vLLM's servers) do not. Nothing changes where
the C library is not glibc (macOS, musl). Imports nothing heavy (no torch).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Mapping, Optional

ENV = "RELAY_HOST_MALLOC"
CHOICES = ("keep", "system")
"""The values of RELAY_HOST_MALLOC; the first is the default."""

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""glibc's mallopt parameters (malloc.h)."""

TRIM_THRESHOLD_MAX = 2**31 - 1
"""mallopt takes an int: the largest trim threshold it can be given."""


def choice(environ: Mapping[str, str] = os.environ) -> str:
    """RELAY_HOST_MALLOC's value (default `keep`).

    Raises:
        ValueError: a value that is not one of CHOICES (the message names them).
    """
    value = environ.get(ENV, "").strip().lower() or CHOICES[0]
    if value not in CHOICES:
        raise ValueError(f"{ENV}={environ.get(ENV)!r} is not one of: {', '.join(CHOICES)}")
    return value


def glibc() -> Optional[ctypes.CDLL]:
    """The process's C library when it is glibc (it has `gnu_get_libc_version` and `mallopt`), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def apply(environ: Mapping[str, str] = os.environ) -> bool:
    """Keep freed memory in this process unless RELAY_HOST_MALLOC says `system`; True when glibc took
    the settings. Settings apply to blocks allocated from then on; idempotent.

    Raises:
        ValueError: RELAY_HOST_MALLOC has an unknown value.
    """
    if choice(environ) != "keep":
        return False
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX))
