"""Executors: how the ranks of a validated, written run dir get started.

    local  torch's elastic launcher starts nnodes x nproc_per_node processes on this machine
    slurm  a SLURM job through submitit, one task per rank (returns once queued, or waits)
    debug  one rank inside the launching process (breakpoints work)

Each is called as `executor(job, run_dir, in_sweep=..., entry=...)` and returns None on success
(or once queued) or the error text of the first failed rank. `entry` is the module every rank runs
(`main(run_dir)`): the trainer, or the machine calibration (titan_exp.perf.calibrate). `in_sweep`: the run is a member
of a multirun; SLURM then queues it with the sweep's other members as one job array (see cluster.slurm).
"""

from __future__ import annotations

from typing import Optional, Protocol

from titan_exp.cluster.env import TRAIN
from titan_exp.config import Executor, JobConfig
from titan_exp.record import RunDir


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
