"""How calibration times things (titan_exp.perf.calibration.measure): every rank at once, compared timings
side by side in rounds, and how much to measure (Options)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass
class Options:
    """calibrate.json in the run dir, written by `python -m titan_exp.perf.calibrate`."""

    refresh: bool = False
    tiny: bool = False  # smallest sizes and fewest repeats: for tests
    # Fewer rounds (QUICK_ROUNDS) and sizes (1 and 2 sequences): what a plan or an autotune sweep
    # measures first of what the profile lacks, in about half a full calibration's time.
    quick: bool = False
    compile: bool = False
    profile_dir: str | None = None  # default: <cache>/perf

    @property
    def reps(self) -> int:
        return 2 if self.tiny else 6

    @property
    def rounds(self) -> int:
        return 1 if self.tiny else QUICK_ROUNDS if self.quick else ROUNDS

    @property
    def sequences(self) -> list[int]:
        return [1, 2] if self.tiny or self.quick else [1, 2, 4]

    @property
    def comm_bytes(self) -> list[int]:
        return [16 << 10, 256 << 10] if self.tiny else [64 << 10, 1 << 20, 8 << 20]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median seconds of `fn` after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(seconds: float, device: torch.device) -> float:
    """The slowest rank's time: a collective step waits for it."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def queued(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Mean seconds of `fn` over `reps` calls launched back to back after one warm-up call, with
    one wait at the end: the host queues a call's kernels while the device runs the last call's,
    so where the device is the slower of the two this is the device's time. `timed` waits after
    each call, and times the host's launching too where it is the slower."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / reps


def together(fn: Callable[[], object], reps: int, device: torch.device, back_to_back: bool = False) -> float:
    """Every rank runs `fn` at the same time; the slowest rank's median (`timed`), or with
    `back_to_back` its mean over calls queued one after another (`queued`)."""
    dist.barrier()
    return slowest((queued if back_to_back else timed)(fn, reps, device), device)


# Rounds of a full calibration: the median of 5 rather than 3 (two calibrations of the 100M model
# at world 2, an hour apart, priced TP at 0.6 s and at 2.0 s a step).
ROUNDS = 5
QUICK_ROUNDS = 3


def in_rounds(fns: list[Callable[[], object]], opts: Options, device: torch.device) -> list[list[float]]:
    """Each of `fns` timed in turn, every rank at once, round after round: [round][fn] seconds.
    Timings compared with each other (sizes fitted as a line, a difference of two models) are
    taken side by side in every round, so a slow spell of a shared machine spoils one round, not
    the comparison (a block's cost was seen to double from one calibration to the
    next, and a line fitted on sizes timed one after the other bends with the machine's speed).
    A full calibration's round times each fn as the median of a third of `opts.reps` calls (2); a
    tiny one (the tests) is one round of all of them."""
    reps = opts.reps if opts.tiny else max(1, opts.reps // 3)
    return [[together(fn, reps, device) for fn in fns] for _ in range(opts.rounds)]


def medians(times: list[list[float]]) -> list[float]:
    """in_rounds' timings: each fn's median over the rounds."""
    return [statistics.median(column) for column in zip(*times)]


@dataclass
class Runs:
    """Callables to time in rounds, and how their timings ([round][fn]) become the measurement."""

    fns: list[Callable[[], object]]
    finish: Callable[[list[list[float]]], Any]


def side_by_side(runs: list[Runs], opts: Options, device: torch.device) -> list[list[list[float]]]:
    """Several Runs' fns timed in the same rounds (in_rounds): each one's timings, [round][fn]."""
    times = in_rounds([fn for r in runs for fn in r.fns], opts, device)
    out, start = [], 0
    for r in runs:
        out.append([row[start:start + len(r.fns)] for row in times])
        start += len(r.fns)
    return out
