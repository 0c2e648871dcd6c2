"""Relay's cache folder (the token cache lives under it, and the embedded model's conversion in
pipeline.modeling.embedded): one definition for both layers, kept in the lower one."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Relay's cache folder: $RELAY_CACHE, else ~/.cache/relay."""
    return Path(os.environ.get("RELAY_CACHE", Path.home() / ".cache" / "relay"))
