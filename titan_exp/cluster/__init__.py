"""Executors: how the ranks of a validated, written run dir get started.

    local  torch's elastic launcher starts nnodes x nproc_per_node processes on this machine
    slurm  a SLURM job through submitit, one task per rank (returns once queued, or waits)
    debug  one rank inside the launching process (breakpoints work)

Each returns None on success (or once queued) or the error text of the first failed rank.
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
    if name == "slurm":
        from titan_exp.cluster.slurm import run_slurm

        return run_slurm
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


def cpu_rank_env(mmap_threshold_mib: int | None) -> dict[str, str]:
    """Environment of a CPU rank: a fixed glibc mmap threshold. With glibc's default (a threshold
    that rises to the largest buffer freed, up to 32 MiB), FSDP's per-block all-gather and
    reduce-scatter buffers come from the heap, fragment it, and a rank's resident memory grows to
    about twice what it uses (BENCHMARKS.md). The user's own MALLOC_* setting wins."""
    if mmap_threshold_mib is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return {}
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold_mib * 2**20)}
