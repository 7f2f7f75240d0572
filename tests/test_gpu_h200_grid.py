"""The 1B's grid on one H200 (benchmarks/data/gpu_h200_grid.json, 2026-11-27, issue 38): every
single-GPU member autotune considers (AC x compile x bf16 / float8 tensorwise / rowwise), measured
beside the planner's predictions from the profile calibrated in the same session
(gpu_h200_grid_profile.json) and from the spec sheet. It was the held-out check named on
2026-11-26 (BENCHMARKS.md); measured, it is no longer held out, and a change of the model that
moves these numbers says so where it is recorded. Checked here on any machine."""

from __future__ import annotations

import functools
import json
import statistics

import pytest
from conftest import REPO, job_config

from titan_exp.perf.devices import SPECS, spec_profile
from titan_exp.perf.fit import spearman
from titan_exp.perf.memory import predict_memory
from titan_exp.perf.profile import MachineProfile
from titan_exp.perf.step import predict_step
from titan_exp.validation import resolve

DATA = REPO / "benchmarks" / "data"
GRID = json.loads((DATA / "gpu_h200_grid.json").read_text())
PROFILE = MachineProfile.from_dict(json.loads((DATA / "gpu_h200_grid_profile.json").read_text()))
ROWS = GRID["rows"]
# The members the memory account was furthest from (held out, 2026-11-27): eager selective AC
# keeps 2.7 GiB more than it counts; compiled float8 with full AC 1.2 GiB more.
MEMORY_MISSES = ("single, AC selective, compile=false, bf16 [local batch 1]",
                 "single, AC full, compile=true, float8 [local batch 1]",
                 "single, AC full, compile=true, float8_rowwise [local batch 1]")


def job_of(row: dict):
    return _job(row["name"])


@functools.cache  # resolving a member's job composes its config: once each
def _job(name: str):
    row = next(r for r in ROWS if r["name"] == name)
    return resolve(job_config([*GRID["base"].split(), *row["overrides"]]))


def errors(predicted: list[float], measured: list[float]) -> list[float]:
    return [abs(p / m - 1) for p, m in zip(predicted, measured)]


def step_times(profile) -> list[float]:
    return [predict_step(job_of(r), profile, cuda=True).step_s for r in ROWS]


def test_the_planner_ranks_the_grid_and_its_first_choice_measures_near_the_best():
    """Issue 38's ranking target, met on the GPU from both profiles: Spearman >= 0.9 on tokens/s.
    The member the calibrated plan ranks first (float8 tensorwise + compile, AC none) measured
    within 3 % of the grid's best, as autotune's winner did. The spec sheet's median |error| stays
    within 10 % (7 % on the GPU); the calibrated profile's, 17 % there, within 20 %."""
    assert len(ROWS) == 18 and all(r["status"] == "ok" for r in ROWS)
    measured = [r["step_s"] for r in ROWS]
    calibrated, spec = step_times(PROFILE), step_times(spec_profile(SPECS["h200"], 1, 1))
    for predicted in (calibrated, spec):
        assert spearman([1 / p for p in predicted], [1 / m for m in measured]) >= 0.9
    first = min(range(len(ROWS)), key=lambda i: calibrated[i])
    assert ROWS[first]["tokens_per_second"] >= 0.97 * max(r["tokens_per_second"] for r in ROWS)
    assert statistics.median(errors(spec, measured)) <= 0.10
    assert statistics.median(errors(calibrated, measured)) <= 0.20


def test_the_memory_the_planner_counts_is_what_the_grid_allocated():
    """The tensors perf.memory_gpu counts (held out: the account was written on 2026-11-26's
    runs) within 3 % of the allocated peak on 15 of the 18 members and within 8 % on all."""
    for r in ROWS:
        parts = predict_memory(job_of(r), cuda=True)
        counted = parts["total"] - parts["rounding"] - parts["workspaces"]
        error = abs(counted / r["peak_allocated_gib"] - 1)
        assert error <= (0.08 if r["name"] in MEMORY_MISSES else 0.03), (r["name"], counted, r["peak_allocated_gib"])


@pytest.mark.xfail(strict=True, reason="issue 38's targets, missed on the H200 (2026-11-27): tokens/s median |error| "
                                       "17 % from the calibrated profile; memory up to 18 % under the reserved peak")
def test_issue_38s_targets_on_the_grid():
    measured = [r["step_s"] for r in ROWS]
    assert statistics.median(errors(step_times(PROFILE), measured)) <= 0.10
    for r in ROWS:
        assert abs(predict_memory(job_of(r), cuda=True)["total"] / r["peak_memory_gib"] - 1) <= 0.10, r["name"]


def test_the_float8_trace_reads_as_it_did_on_the_gpu(tmp_path):
    """titan_exp.perf.trace.gpu_summary on the 3B's float8 + compile step traced that session
    gives what it gave there (4,338 kernels, the GPU idle under 5 % of the step)."""
    import gzip

    from titan_exp.perf.trace import gpu_summary

    there = next(r["trace"] for r in GRID["suite_rows"] if r["config"] == "float8 tensorwise + compile, traced")
    path = tmp_path / "trace.json"
    path.write_bytes(gzip.decompress((DATA / "gpu_h200_trace_llama3_3b_float8_compile.json.gz").read_bytes()))
    here = gpu_summary(path)
    assert here == there
    assert here["kernels"] == 4338 and here["idle_s"] / here["window_s"] < 0.05


def test_a_gpu_plan_with_eager_selective_ac_says_it_is_optimistic():
    """The grid's eager selective-AC members measured 26-38 % slower than predicted, host-bound
    (its per-op policy in Python); their plans say so, and no other member's does."""
    for r in ROWS:
        notes = predict_step(job_of(r), PROFILE, cuda=True).notes
        eager_selective = "AC selective, compile=false" in r["name"]
        assert any(n.startswith("selective AC without compile") for n in notes) == eager_selective, r["name"]
