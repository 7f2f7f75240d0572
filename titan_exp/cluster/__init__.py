"""Executors: how the ranks of a validated, written run dir get started.

    local  torch's elastic launcher starts nnodes x nproc_per_node processes on this machine
    debug  one rank inside the launching process (breakpoints work)

Each returns None on success or the error text of the first failed rank.
"""

from __future__ import annotations

from typing import Callable, Optional

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
