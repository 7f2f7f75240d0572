"""How far off the planner's predictions were when last checked against measurements, which a plan
and an autotune record quote beside their numbers:

- the project's record, `accuracy.json` beside this file: spec-sheet plans against published GPU
  training runs (`published`, written by `python -m benchmarks.published --record`), and this
  toolkit's CPU predictions from a calibrated profile and from FLOPs estimates (`calibrated`,
  `flops_estimates`, from benchmarks/bench_perf_model.py and bench_autotune_user.py);
- this machine's own record (`accuracy.json` in the profile folder), which an autotune sweep
  writes after measuring its candidates and which wins over the project's.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_exp.files import atomic_write
from titan_exp.perf.rates.profile import MachineProfile, profiles_dir

RECORDED = Path(__file__).with_name("accuracy.json")


@functools.cache
def recorded() -> dict[str, Any]:
    """The project's record (RECORDED), as the command that measured each entry wrote it."""
    return json.loads(RECORDED.read_text())


def published() -> dict[str, Any]:
    """How spec-sheet plans fared, held out, against published GPU training runs: the rows scored,
    their tokens/s median |error|, of the pairs of rows one table ran on one machine how many were
    ordered as published and of all (`pairs_ordered`); by spec sheet, its rows, median signed error
    (predicted over published, less 1) and median |error| (`by_device`); and the memory model's rows,
    median and worst |error| on the rows that publish memory (`memory`)."""
    return recorded()["published"]


@dataclass(frozen=True)
class Check:
    """How far off one kind of prediction was against measured runs: the median |tokens/s error|."""

    median_abs_error: float
    when: str
    where: str


ESTIMATES = "flops-estimates"  # the key under which a machine records how its FLOPs estimates did


def last_check(profile: MachineProfile, *, estimated: bool, folder: Path | None = None) -> Check:
    """How far off this profile's predictions were when last checked: a refit's own residual, this
    machine's record (of its defaults, or of FLOPs estimates), else the project's (project_check)."""
    c = profile.corrections
    if not estimated and c.measurements and c.median_error_after is not None:
        return Check(c.median_error_after, profile.created, f"this profile's refit to {c.measurements} runs")
    seen = last_accuracy(ESTIMATES if estimated else accuracy_kind(profile), folder)
    if seen:
        return Check(seen["median_abs_error"], seen["when"], f"{seen['runs']} runs on this machine")
    return project_check("flops_estimates" if estimated or profile.source == "defaults" else "calibrated")


def estimates_line(missing: list[str], profile: MachineProfile, folder: Path | None) -> str:
    """What a plan or an autotune record says first when it predicts parts it did not measure."""
    check = last_check(profile, estimated=True, folder=folder)
    return (f"PREDICTIONS ARE FLOPs ESTIMATES for {'; '.join(missing)} (autotune.calibrate=false): when last "
            f"checked ({check.when}, {check.where}) such estimates were off by a median "
            f"{check.median_abs_error:.0%} in tokens/s")


# -- how wrong predictions were on this machine: kept so `plan` can say so beside its own -------
def record_accuracy(kind: str, median_abs_error: float, runs: int, folder: Path | None = None) -> None:
    """Record how far off one kind of prediction was here (`kind`: a profile's name, "defaults",
    or perf.rates.accuracy.ESTIMATES)."""
    path = (folder or profiles_dir()) / "accuracy.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    known[kind] = {"median_abs_error": median_abs_error, "runs": runs, "when": time.strftime("%Y-%m-%d %H:%M")}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(known, indent=1))


def accuracy_kind(profile: MachineProfile) -> str:
    return profile.source if profile.source == "defaults" else profile.name


def last_accuracy(kind: str, folder: Path | None = None) -> dict[str, Any] | None:
    path = (folder or profiles_dir()) / "accuracy.json"
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(kind)


def project_check(kind: str) -> Check:
    """The project's record of `kind`: "calibrated" (a calibrated CPU profile) or "flops_estimates"."""
    entry = recorded()[kind]
    return Check(entry["median_abs_error"], entry["when"], entry["where"])
