"""Signals that end a run cleanly: SIGTERM, SIGINT and SIGUSR2 stop every rank at the same step
boundary, after which the trainer writes a checkpoint (when enabled) and the summary says
`interrupted`.

A handler only records the signal (it does not even log: a handler that writes to a stream the
interrupted code is writing to can fail with a reentrant-call error); the training loop asks
`stop_requested()` once per step, and the ranks agree through one all-reduce, because a signal reaches each rank at a
slightly different moment (SLURM signals every task; Ctrl-C the whole process group; `kill` one rank).
Before the first step there is no step boundary to stop at while a rank waits at the rendezvous
for the others (one lost before it joined, a node slow to start): `stoppable` ends that wait when
a stop signal arrives, with `Stopped`, instead of after comm.init_timeout_seconds or the
process manager's SIGKILL.

    SIGUSR2  SLURM's warning before a time limit or preemption (`--signal=USR2@...`, what
             submitit asks for); under SLURM the job requeues itself afterwards
             (titan_exp.cluster.slurm). NCCL owns SIGUSR1, so it is not used.
    SIGTERM  scancel, a time limit reached, a process manager stopping the job
    SIGINT   Ctrl-C

A local rank also stops as for SIGTERM when its launcher's process ends, however it ended (kill -9
included): `stop_with_launcher` watches it, so a rank never outlives its launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

logger = logging.getLogger("titan_exp")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
EXIT_INTERRUPTED = 3  # the exit code of a process that stopped for a stop signal (the launcher's too)
LAUNCHER_PID = "TITAN_EXP_LAUNCHER_PID"  # set by the local executor for its ranks: the process they serve

_received: list[int] = []
_previous: dict[int, Any] = {}


def _record(signum: int, frame) -> None:
    _received.append(signum)


@contextlib.contextmanager
def catch_stop_signals() -> Iterator[None]:
    """Record STOP_SIGNALS instead of acting on them. Re-entrant: an inner block inside an outer
    one changes nothing, so a wrapper (the SLURM task) can keep recording after training ends."""
    if _previous:
        yield
        return
    _received.clear()
    for sig in STOP_SIGNALS:
        _previous[sig] = signal.signal(sig, _record)
    try:
        yield
    finally:
        for sig, handler in _previous.items():
            signal.signal(sig, handler)
        _previous.clear()


def previous_handler(sig: int) -> Any:
    """The handler that was installed before catch_stop_signals (submitit's, in a SLURM job)."""
    return _previous.get(sig)


def received() -> list[str]:
    """The stop signals recorded since the last catch_stop_signals block began (it may have ended)."""
    return [signal.Signals(s).name for s in dict.fromkeys(_received)]


def wait_for(sig: int, timeout_s: float) -> bool:
    """Whether `sig` has been recorded (by catch_stop_signals), waiting up to `timeout_s` for it."""
    deadline = time.monotonic() + timeout_s
    while sig not in _received:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class Stopped(Exception):
    """A stop signal arrived while the rank waited where it cannot stop at a step boundary."""

    def __init__(self, names: list[str], what: str):
        super().__init__(f"{' and '.join(names)} arrived while this rank was {what}; it stopped there, "
                         "before training started")
        self.names = names


def stoppable(wait: Callable[[], T], what: str, poll_s: float = 0.1) -> T:
    """`wait()`'s result, or Stopped as soon as catch_stop_signals records a stop signal while it
    waits (`what`: the wait, as a user reads it). A call blocked in C++ (torch's TCPStore waiting
    for the other ranks) holds the main thread where Python runs no signal handler: it runs on a
    daemon thread instead, which the rank leaves behind when it stops. Its exception is raised
    here."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = wait()
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="stoppable wait", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        if thread.is_alive() and _received:
            raise Stopped(received(), what)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def stop_requested(group=None) -> list[str]:
    """The stop signals any rank has received (empty: keep going); a collective over `group`,
    so every rank must call it at the same point and all get the same answer."""
    import torch
    import torch.distributed as dist

    seen = torch.tensor([int(s in _received) for s in STOP_SIGNALS], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    return [sig.name for sig, hit in zip(STOP_SIGNALS, seen.tolist()) if hit]


def stop_with_launcher() -> None:
    """Stop this rank as SIGTERM would when the process named by LAUNCHER_PID ends, whatever ended
    it: under catch_stop_signals at the next step boundary, with its checkpoint; outside it at
    once. A daemon thread waits for the launcher, so a rank never outlives it (a forked rank's
    parent is the forkserver, which itself lives as long as its ranks do). No-op where the variable
    is not set (SLURM's tasks, the debug executor)."""
    if LAUNCHER_PID not in os.environ:
        return
    pid = int(os.environ[LAUNCHER_PID])

    def watch() -> None:
        _wait_for_exit(pid)
        logger.warning("the launcher (pid %d) has exited: this rank stops as for SIGTERM", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher watch", daemon=True).start()


def _wait_for_exit(pid: int, poll_s: float = 0.5) -> None:
    """Return once process `pid` has exited: at once through a pidfd (Linux), else by polling."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        while _exists(pid):
            time.sleep(poll_s)
        return
    try:
        exited = select.poll()
        exited.register(fd, select.POLLIN)
        exited.poll()
    finally:
        os.close(fd)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or its pid reused by another user's process
        return False
    return True
