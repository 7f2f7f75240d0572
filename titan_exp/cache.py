"""The on-disk cache shared by runs on a machine: $TITAN_EXP_CACHE (default ~/.cache/titan_exp).
It holds the default corpus, trained tokenizers, per-config inductor caches and the CPU peak."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Private to its user (0700): torch's inductor cache, kept in here, loads pickles, so no other
    user may be able to put files in it. Everything titan_exp itself caches is JSON or text."""
    path = Path(os.environ.get("TITAN_EXP_CACHE", "~/.cache/titan_exp")).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o022:
        os.chmod(path, path.stat().st_mode & ~0o022)  # made by an older version, or by hand
    return path
