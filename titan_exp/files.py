"""Writing files so that a reader never sees half of one, and probing where writing is possible."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


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
