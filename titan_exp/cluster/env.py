"""What every executor shares: the module its ranks run by default, and an environment set only
for the ranks started inside a block."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

TRAIN = "titan_exp.train.rank"  # the default entry: `python -m titan_exp.train.rank RUN_DIR`


@contextlib.contextmanager
def scoped_env(**values: str) -> Iterator[None]:
    """Set environment variables for the ranks started inside the block, then restore them, so
    one member of a sweep never leaks its settings into the next."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def checkout_path() -> dict[str, str]:
    """PYTHONPATH for local ranks started as `python -m <entry>`, and for the forkserver the forked
    ones come from (cluster/forkserver.py), which import titan_exp from their own sys.path: run
    from a checkout (`python path/to/launch.py` from another directory, with no titan_exp installed,
    or another one: an older wheel, an editable install of another checkout), they would fail to
    import it or run other code than the launcher validated. The checkout goes first; an installed
    titan_exp (no pyproject.toml beside the package) needs none."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        return {}
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
