"""Relay's cache folder (the token cache lives under it, and the embedded model's conversion in
pipeline.modeling.embedded): one definition for both layers, kept in the lower one; and the lock
that lets one of several processes (ranks, test workers) build a cache entry while the others wait."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # Windows: no advisory locks
    fcntl = None


def cache_root() -> Path:
    """Relay's cache folder: $RELAY_CACHE, else ~/.cache/relay."""
    return Path(os.environ.get("RELAY_CACHE", Path.home() / ".cache" / "relay"))


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (created if missing, readable by all, left in place) for
    the body: one process or thread at a time, on this machine; where the platform has no `fcntl`
    (Windows), no lock. The file is opened for reading only, so every user of a shared cache folder
    can take the lock another user's process created."""
    handle = os.open(lock_file, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)
