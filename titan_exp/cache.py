"""The on-disk cache shared by runs on a machine: $TITAN_EXP_CACHE (default ~/.cache/titan_exp).
It holds the default corpus, trained tokenizers, per-config inductor caches and the CPU peak."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def cache_dir() -> Path:
    """Private to its user (0700): torch's inductor cache, kept in here, loads pickles, so no other
    user may be able to put files in it. Everything titan_exp itself caches is JSON or text."""
    path = Path(os.environ.get("TITAN_EXP_CACHE", "~/.cache/titan_exp")).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o022:
        os.chmod(path, path.stat().st_mode & ~0o022)  # made by an older version, or by hand
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


def unwritable(folder: Path) -> str | None:
    """Why nothing can be written in `folder` (probing its nearest existing ancestor), or None."""
    probe = folder
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    try:
        with open(probe / f".titan_exp_probe_{time.time_ns()}", "wb") as f:
            f.write(b"x")
        Path(f.name).unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
