"""Local processes through torch's elastic launcher (what torchrun uses), gloo on CPU."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from typing import Optional

from titan_exp.cluster import scoped_env
from titan_exp.config import JobConfig
from titan_exp.run_dir import RunDir


def threads_per_rank(nproc: int) -> int:
    """OMP threads each local rank gets: the user's OMP_NUM_THREADS, else an even split of the cores."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // nproc))


def rank_env(job: JobConfig, nproc: int) -> dict[str, str]:
    """Environment of the local ranks. On CPU, a fixed glibc mmap threshold: with glibc's
    default (a threshold that rises to the largest buffer freed, up to 32 MiB), FSDP's per-block
    all-gather and reduce-scatter buffers come from the heap, fragment it, and a rank's resident
    memory grows to about twice what it uses (BENCHMARKS.md). The user's own MALLOC_* wins."""
    import torch

    env = {"OMP_NUM_THREADS": str(threads_per_rank(nproc))}
    threshold = job.cluster.cpu_malloc_mmap_threshold_mib
    if threshold is not None and not torch.cuda.is_available() and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env["MALLOC_MMAP_THRESHOLD_"] = str(threshold * 2**20)
    return env


def run_local(job: JobConfig, run_dir: RunDir) -> Optional[str]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    nproc = job.cluster.nnodes * job.cluster.nproc_per_node
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, chosen by the OS: runs never collide
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        with scoped_env(**rank_env(job, nproc)):
            elastic_launch(config, entrypoint=sys.executable)("-m", "titan_exp.train", str(run_dir.path))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        return f"rank {rank} exited with code {failure.exitcode}: {message}".strip()
    return None
