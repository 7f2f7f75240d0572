"""Executors: how the ranks of a validated, written run dir get started.

    local  torch's elastic launcher starts nnodes x nproc_per_node processes on this machine
    debug  one rank inside the launching process (breakpoints work)

Each returns None on success or the error text of the first failed rank.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional

from titan_exp.config import JobConfig
from titan_exp.run_dir import RunDir

Executor = Callable[[JobConfig, RunDir], Optional[str]]


def get_executor(name: str) -> Executor:
    if name == "local":
        from titan_exp.cluster.local import run_local

        return run_local
    if name == "debug":
        from titan_exp.cluster.debug import run_debug

        return run_debug
    raise ValueError(f"unknown executor {name!r}")  # validation rejects this earlier


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
