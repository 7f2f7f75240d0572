"""Deliberate faults, for the tests that prove a run survives them.

    TITAN_EXP_FAULT=<point>@<step>[:<rank>]     e.g. save@6:0, step@7:1

kills the rank (default: every rank) with SIGKILL when it reaches `point` at `step`:
  step  after the step's optimizer update, before its checkpoint
  save  once this rank's share of the step's checkpoint is written (a synchronous save) or
        handed to the background writer (async), and before the checkpoint is marked complete

The variable is read where the faults would happen, so a relaunch without it runs normally.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger("titan_exp.faults")


def maybe_fault(point: str, step: int) -> None:
    spec = os.environ.get("TITAN_EXP_FAULT")
    if not spec:
        return
    where, _, rank = spec.partition(":")
    name, _, at = where.partition("@")
    if name == point and int(at) == step and (not rank or int(rank) == int(os.environ.get("RANK", 0))):
        logger.warning("TITAN_EXP_FAULT=%s: killing this rank", spec)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
