"""Predictions against measurements: rank correlation, errors, refitting a profile's
corrections to measured runs (so the next plan on the same machine is better), and how far off
predictions were when last checked: what a plan says beside them, and how wide the interval is
that autotune gives each prediction."""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Sequence

import numpy as np

from titan_exp.perf.model.comm import COMM_PARTS
from titan_exp.perf.model.step import StepPrediction
from titan_exp.perf.rates.accuracy import Check
from titan_exp.perf.rates.profile import Corrections, MachineProfile

# Half-width of a prediction's interval, in median errors: about 90 % of normally spread errors.
BAND = 2.5


def predicted_interval(tokens_per_s: float, check: Check) -> tuple[float, float]:
    """Where a prediction's true value likely lies: BAND median errors either way."""
    spread = 1 + BAND * check.median_abs_error
    return tokens_per_s / spread, tokens_per_s * spread


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the ranks)."""
    if len(a) < 2:
        return float("nan")
    ra, rb = np.array(ranks(a)), np.array(ranks(b))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> list[float]:
    """predicted / measured - 1, per pair."""
    return [p / m - 1 for p, m in zip(predicted, measured)]


def median_abs(errors: Sequence[float]) -> float:
    return statistics.median(abs(e) for e in errors) if errors else float("nan")


# Student's t, two-sided 95 %, by degrees of freedom (then the normal's 1.96).
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
       15: 2.13, 20: 2.09, 30: 2.04}


def throughput_interval(step_times: Sequence[float], tokens_per_step: int, world: int) -> tuple[float, float, float]:
    """(tokens/s per device, low, high): the mean step time's 95 % interval, as throughput."""
    n = len(step_times)
    mean = statistics.fmean(step_times)
    rate = tokens_per_step / world / mean
    if n < 2:
        return rate, float("nan"), float("nan")
    t = T95[max(k for k in T95 if k <= n - 1)]
    half = t * statistics.stdev(step_times) / n**0.5
    high = tokens_per_step / world / (mean - half) if mean > half else float("inf")
    return rate, tokens_per_step / world / (mean + half), high


def refit(profile: MachineProfile, runs: Sequence[tuple[StepPrediction, float]]) -> MachineProfile:
    """New corrections from (prediction made with `profile`, measured seconds per step) pairs:
    measured ~ a x compute + b x communication + c, weighted to minimise relative error. With
    fewer than four runs (or a fit that makes a term negative) only one scale for everything."""
    if not runs:
        return profile
    measured = np.array([m for _, m in runs])
    comm = np.array([sum(p.parts.get(k, 0.0) for k in COMM_PARTS) for p, _ in runs])
    overhead = np.array([p.parts.get("overhead", 0.0) for p, _ in runs])
    compute = np.array([p.step_s for p, _ in runs]) - comm - overhead
    w = 1 / measured
    a = b = None
    c = 0.0
    if len(runs) >= 4 and comm.any():
        design = np.stack([compute, comm, np.ones_like(compute)], axis=1) * w[:, None]
        (a, b, c), *_ = np.linalg.lstsq(design, (measured - overhead) * w, rcond=None)
        if a <= 0 or b <= 0 or c < -overhead.min():
            a = None
    if a is None:
        scale = float(np.median(measured / np.array([p.step_s for p, _ in runs])))
        a = b = scale
        c = 0.0
    old = profile.corrections
    before = median_abs(relative_errors([p.step_s for p, _ in runs], measured))
    fitted = a * compute + b * comm + overhead + c
    after = median_abs(relative_errors(fitted, measured))
    corrections = Corrections(compute=old.compute * float(a), communication=old.communication * float(b),
                              overhead_s=old.overhead_s + float(c), measurements=old.measurements + len(runs),
                              median_error_before=before, median_error_after=after)
    return replace(profile, corrections=corrections)
