"""What every executor shares: the module its ranks run by default, and an environment set only
for the ranks started inside a block."""

from __future__ import annotations

import contextlib
import os
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
