"""The on-disk cache shared by runs on a machine: $TITAN_EXP_CACHE (default ~/.cache/titan_exp).
It holds the default corpus, trained tokenizers, per-config inductor caches and the CPU peak."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    path = Path(os.environ.get("TITAN_EXP_CACHE", "~/.cache/titan_exp")).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def atomic_write(path: Path, data: str) -> None:
    """Write whole or not at all: concurrent readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # mkstemp makes it private; these files are for every reader
    os.replace(tmp, path)
