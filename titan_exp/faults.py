"""Deliberate faults, for the tests that prove a run survives them.

    TITAN_EXP_FAULT=<point>@<step>[:<rank>]     e.g. save@6:0, step@7:1, hang@3:1, nan@4, slow@5

acts on the rank (default: every rank) when it reaches `point` at `step`:
  step  SIGKILL after the step's optimizer update, before its checkpoint
  save  SIGKILL once this rank's share of the step's checkpoint is written (a synchronous save)
        or handed to the background writer (async), and before the checkpoint is marked complete
  hang  sleep forever at the start of the step (a rank stuck outside any collective); step 0:
        before the rendezvous (a rank that never joins)
  nan   make the step's loss NaN (so its gradients are too)
  slow  sleep SLOW_S inside the step's timed part (a stall: a busy neighbour, a slow file system)
  exit  abort (SIGABRT, as gloo sometimes does in teardown) after the rank finished; step 0
  init  SIGKILL before the rendezvous (as when rank 0's port is taken); step 0

The variable is read where the faults would happen, so a relaunch without it runs normally.
"""

from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger("titan_exp.faults")
SLOW_S = 2.0


def _matches(point: str, step: int) -> bool:
    spec = os.environ.get("TITAN_EXP_FAULT")
    if not spec:
        return False
    where, _, rank = spec.partition(":")
    name, _, at = where.partition("@")
    return name == point and int(at) == step and (not rank or int(rank) == int(os.environ.get("RANK", 0)))


def inject(point: str, step: int) -> bool:
    """The one seam: a no-op returning False unless TITAN_EXP_FAULT names this point, step and
    rank. Then it hangs (hang), aborts (exit) or kills the rank (step, save), or returns True for
    the caller to act on (nan: the trainer poisons that step's loss), or sleeps SLOW_S (slow)."""
    if not _matches(point, step):
        return False
    if point == "nan":
        return True
    if point == "slow":
        logger.warning("TITAN_EXP_FAULT=%s: sleeping %.0f s in step %d", os.environ["TITAN_EXP_FAULT"], SLOW_S, step)
        time.sleep(SLOW_S)
        return True
    logger.warning("TITAN_EXP_FAULT=%s: %s", os.environ["TITAN_EXP_FAULT"],
                   "hanging" if point == "hang" else "ending this rank")
    for handler in logging.getLogger().handlers:
        handler.flush()
    if point == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGABRT if point == "exit" else signal.SIGKILL)
    return True
