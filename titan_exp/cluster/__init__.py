"""Executors: how the ranks of a validated, written run dir get started.

    local  torch's elastic launcher starts nnodes x nproc_per_node processes on this machine
    slurm  a SLURM job through submitit, one task per rank (returns once queued, or waits)
    debug  one rank inside the launching process (breakpoints work)

Each is called as `executor(job, run_dir, in_sweep=..., entry=...)` and returns None on success
(or once queued) or the error text of the first failed rank. `entry` is the module every rank runs
(`main(run_dir)`): the trainer, or the machine calibration (titan_exp.perf.calibrate). `in_sweep`: the run is a member of a multirun;
SLURM then queues it with the sweep's other members as one job array (see cluster.slurm).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Protocol

from titan_exp.config import ClusterConfig, Executor, JobConfig, problem
from titan_exp.record import RunDir


TRAIN = "titan_exp.train.rank"  # the default entry: `python -m titan_exp.train.rank RUN_DIR`


class RunRanks(Protocol):
    def __call__(self, job: JobConfig, run_dir: RunDir, *, in_sweep: bool, entry: str = TRAIN) -> Optional[str]: ...


def get_executor(name: Executor) -> RunRanks:
    if name == Executor.local:
        from titan_exp.cluster.local import run_local

        return run_local
    if name == Executor.slurm:
        from titan_exp.cluster.slurm import run_slurm

        return run_slurm
    from titan_exp.cluster.debug import run_debug

    return run_debug


def check(job: JobConfig, cuda: bool) -> list[str]:
    """Rules of every executor; SLURM's own are in cluster.slurm.preflight.check."""
    e: list[str] = []
    c = job.cluster
    if c.cpu_malloc_mmap_threshold_mib is not None and not 0 <= c.cpu_malloc_mmap_threshold_mib <= 32:
        e.append(problem("cluster.cpu_malloc_mmap_threshold_mib", c.cpu_malloc_mmap_threshold_mib,
                         "glibc accepts 0..32 MiB; or null for its default"))
    if c.nproc_per_node is not None and c.nproc_per_node < 1:
        e.append(problem("cluster.nproc_per_node", c.nproc_per_node, "must be >= 1, or null to derive it from the degrees"))
        return e
    if c.nproc_per_node is None and job.world_size % c.nnodes:
        e.append(problem("cluster.nnodes", c.nnodes,
                         f"does not divide the {job.world_size} ranks the degrees need; set cluster.nproc_per_node"))
    if c.dry_run and c.dry_run_rank >= job.world_size:
        e.append(problem("cluster.dry_run_rank", c.dry_run_rank, f"the layout has ranks 0..{job.world_size - 1}"))
    if c.dry_run:
        return e  # one rank, here: the rules below are about starting every rank
    if cuda and c.executor == Executor.local and c.nproc_per_node is not None:
        import torch

        visible = torch.cuda.device_count()
        if c.nproc_per_node > visible:
            e.append(problem("cluster.nproc_per_node", c.nproc_per_node,
                             f"one rank per GPU, and this machine shows {visible} (CUDA_VISIBLE_DEVICES); "
                             f"use at most {visible}"))
    if c.executor == Executor.debug and job.world_size != 1:
        e.append(problem("cluster.executor", c.executor,
                         f"runs one rank in-process but the world size is {job.world_size}; use cluster=local"))
    return e


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


def rank_env(c: ClusterConfig, *, threads: int, gpu: bool) -> dict[str, str]:
    """Environment of every rank, local or on SLURM: its share of the cores, and on a CPU rank a
    fixed glibc mmap threshold. With glibc's default (a threshold that rises to the largest buffer
    freed, up to 32 MiB), FSDP's per-block all-gather and reduce-scatter buffers come from the
    heap, fragment it, and a rank's resident memory grows to about twice what it uses
    (BENCHMARKS.md). The user's own MALLOC_* setting wins."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if not gpu and c.cpu_malloc_mmap_threshold_mib is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env["MALLOC_MMAP_THRESHOLD_"] = str(c.cpu_malloc_mmap_threshold_mib * 2**20)
    return env
