"""A rank that dies or hangs must not leave the others waiting forever.

Two guards, both from `comm` (TorchTitan's names):
  - collective timeouts: every process group waits at most comm.init_timeout_seconds until the
    first step is done (rendezvous, first gathers, compilation), then comm.train_timeout_seconds.
    A rank whose peer died or hangs gets an error from its collective instead of waiting.
  - a watchdog around each step (faulthandler's timer): a step that runs GRACE_S longer than the
    collective timeout writes every thread's stack to the rank's log and ends the rank with exit
    code 1. This catches a rank stuck outside any collective, which no collective timeout sees:
    its peers time out in their collective first, and a few seconds later (inside the launcher's
    30 s grace before SIGKILL) the stuck rank's watchdog fires, so its log says where it hung and
    the launcher can name it (`hung_ranks`).
"""

from __future__ import annotations

import faulthandler
import logging
import sys
from datetime import timedelta
from pathlib import Path

from titan_exp.config import CommConfig, JobConfig, problem

logger = logging.getLogger("titan_exp")


GRACE_S = 5
HEADER = "Timeout ("  # how faulthandler starts its dump


def check(job: JobConfig, cuda: bool) -> list[str]:
    return [problem(f"comm.{name}", getattr(job.comm, name), "must be >= 1 (seconds)")
            for name in ("init_timeout_seconds", "train_timeout_seconds") if getattr(job.comm, name) < 1]


def step_deadline(comm: CommConfig, first: bool) -> float:
    """Seconds a step may run before the watchdog ends the rank."""
    return (comm.init_timeout_seconds if first else comm.train_timeout_seconds) + GRACE_S


def set_collective_timeouts(mesh, seconds: int) -> None:
    """The train timeout for the default group and every dimension of the mesh. torch has no
    public setter yet; this is the private one TorchTitan uses too."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    groups = [None] + ([mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else [])
    for group in groups:
        _set_pg_timeout(timedelta(seconds=seconds), group)


class _Watchdog:
    def __init__(self) -> None:
        self.armed = False

    def arm(self, step: int, seconds: float) -> None:
        """(Re)start the timer for `step`: if it runs out, dump stacks to the rank log and exit."""
        if not self.armed:
            logger.info("watchdog: a step running past %g s (comm timeout + %d s) ends this rank, with its "
                        "stacks in this log", seconds, GRACE_S)
        faulthandler.dump_traceback_later(seconds, exit=True, file=_log_stream())
        self.armed = True

    def disarm(self) -> None:
        if self.armed:
            faulthandler.cancel_dump_traceback_later()
            self.armed = False


def _log_stream():
    """The rank log's file (titan_exp.train.setup_logging), else stderr."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            return handler.stream
    return sys.stderr


watchdog = _Watchdog()


def hung_ranks(log_dir: Path) -> list[int]:
    """Ranks whose watchdog fired, from their logs (<run dir>/logs/rank-K.log)."""
    return sorted(int(log.stem.split("-")[1]) for log in log_dir.glob("rank-*.log")
                  if HEADER in log.read_text(errors="replace"))
