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
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)

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
            raise Stopped([signal.Signals(s).name for s in dict.fromkeys(_received)], what)
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
