"""The H200 runs of 2026-11-28, evening (benchmarks/data/gpu_h200_grid_1b_tied.json): the check
named after the 3B's grid, before it ran (BENCHMARKS.md, "Planner and autotune on one NVIDIA
H200"): the 1B's grid with its embeddings tied, from a profile calibrated there that measured
torchao's float8 cast rates, float8 GEMMs with fast accumulation and the block's own memory-bound
rate for the first time; autotune given a quarter of the grid's time; the tied 3B's compiled
steps traced; and torchao's float8 shape filter on the 1B and the 3B. Measured, none is held out
any more; checked here on any machine."""

from __future__ import annotations

import functools
import json
import statistics

import pytest
from conftest import REPO, as_ran, errors, job_config, rank_correlation

from benchmarks.gpu_suite import CONFIGS  # the suite's configurations, as the rows name them
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import gpu_work_by_kind, predict_step
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.profile import MachineProfile
from titan_exp.validation import resolve

DATA = REPO / "benchmarks" / "data"
GRID = json.loads((DATA / "gpu_h200_grid_1b_tied.json").read_text())
PROFILE = MachineProfile.from_dict(json.loads((DATA / GRID["profile"]).read_text()))
ROWS = GRID["rows"]
EARLIER = {"1b untied": "gpu_h200_grid", "8b": "gpu_h200_grid_8b", "3b untied": "gpu_h200_grid_3b"}


@functools.cache
def job(overrides: tuple[str, ...]):
    return resolve(job_config(list(overrides)))


def member(row: dict, grid: dict = GRID):
    return job((*grid["base"].split(), *row["overrides"], *as_ran(grid)))


def suite_job(model: str, config: str):
    return job((f"model={model}", "training.seq_len=8192", "training.local_batch_size=1",
                "training.global_batch_size=1", *CONFIGS[config]))


def test_the_tied_1b_grid_met_issue_38s_step_time_targets_held_out():
    """All 18 members measured in 154 s, each beside the prediction the grid gave there from the
    profile calibrated in the same call, which the planner still gives. Calibrated: Spearman 0.94
    (target 0.9), median |error| 6.6 % (target 10 %; named: at most 12 %), worst 21 % (eager
    float8 with selective AC, host-bound, and float8 + compile under AC, priced slow); the plan's
    first choice, float8 tensorwise + compile without AC, measured within 1 % of the best. The spec
    sheet: 0.92, 10.3 % (11.4 % before a spec sheet's host times became the medians of this
    project's H200 calibrations, this grid's among them: not held out)."""
    assert len(ROWS) == 18 and all(r["status"] == "ok" for r in ROWS)
    seconds = [r["step_s"] for r in ROWS]
    calibrated = [predict_step(member(r), PROFILE, cuda=True).step_s for r in ROWS]
    assert calibrated == pytest.approx([r["predicted_step_s"] for r in ROWS], rel=1e-9)
    spec = [predict_step(member(r), spec_profile(SPECS["h200"], 1, 1), cuda=True).step_s for r in ROWS]
    # The targets named before it ran: Spearman >= 0.9, median |error| <= 12 % (and 10 %, issue's);
    # the worst within the 25 % the published validation allows.
    assert rank_correlation(calibrated, seconds) >= 0.9
    assert statistics.median(errors(calibrated, seconds)) <= 0.10
    assert max(errors(calibrated, seconds)) <= 0.25
    assert rank_correlation(spec, seconds) >= 0.9 and statistics.median(errors(spec, seconds)) <= 0.12
    first = ROWS[min(range(len(ROWS)), key=lambda i: calibrated[i])]
    assert first["tokens_per_second"] >= 0.99 * max(r["tokens_per_second"] for r in ROWS)


def test_the_tied_1b_grids_memory_within_issue_38s_target_since_float8s_blocks_are_counted_apart():
    """On the GPU the planner was within 10 % of the reserved peak on 14 of 18 members; the misses
    float8 + compile without AC and with selective AC, 10.7-11.2 % over. Since a float8 block on
    CUDA is counted without the compiled bf16 block's extra (memory_gpu.CUDA_EXTRA, chosen from
    these rows and the tied 3B's, so in sample here), all 18, worst 6.4 %."""
    now = [abs(predict_memory(member(r), cuda=True)["total"] / r["peak_memory_gib"] - 1) for r in ROWS]
    assert max(now) <= 0.10  # the memory target, on every member


def test_the_tied_3b_compiled_steps_traced_against_what_was_named():
    """Named for them before they ran: the optimizer phase priced at 30 ms (traced 29.4-29.6: met);
    their memory 4.4 GiB under the untied runs' (bf16 + compile 68.68 GiB reserved, 73.04 untied:
    met); float8 tensorwise + compile's GEMMs priced 8-15 % slow (11.7 %: met); bf16 + compile's
    memory-bound work within 15 % of its trace (priced 72.9 ms, traced 46.3: missed, 57 % slow:
    calibration's compiled block ran at 0.48 of the contiguous add's rate, the model's own kernels
    at 0.77; measure_kernels.ELEMENTWISE_SEQUENCES)."""
    rows = {r["config"]: r for r in GRID["suite_rows"]}
    bf16, f8 = rows["bf16 + compile, traced"], rows["float8 tensorwise + compile, traced"]
    for row in (bf16, f8):
        here = gpu_work_by_kind(suite_job("llama3_3b", row["config"]), PROFILE)
        there = row["trace"]["busy_by_kind_ms"]
        assert here["optimizer"] * 1e3 == pytest.approx(30.9, abs=0.1) and 29 < there["optimizer"] < 30
        if row is f8:
            assert 1.08 < here["gemm"] * 1e3 / there["gemm"] < 1.15
        else:
            assert here["memory_bound"] * 1e3 / there["memory_bound"] == pytest.approx(1.57, abs=0.01)


def test_the_shape_filter_runs_are_predicted_from_this_profile():
    """torchao's float8 shape filter (precision.filter_fqns=[output,auto_filter_small_kn]) measured
    beside the same recipe without it on the 1B and the 3B (BENCHMARKS.md has the ratios): this
    profile prices every such run slow, by less than 15 % with the filter and 9 % without."""
    runs = GRID["shape_filter_rows"]
    for model, rows in runs.items():
        for r in rows:
            predicted = predict_step(suite_job(model, r["config"]), PROFILE, cuda=True).step_s
            assert 0.0 < predicted / r["step_s"] - 1 < (0.15 if "small linears" in r["config"] else 0.09), r["config"]


def test_this_profile_predicts_the_earlier_grids_within_issue_38s_targets():
    """Not named before it was computed, and nothing in it fitted: this profile, calibrated on the
    tied 1B (the first with float8 cast rates, fast-accumulation GEMMs and the block's memory-bound
    rate), predicts the three earlier grids, measured on 2026-11-27 and 2026-11-28, within issue
    38's step-time targets, where their own profiles did not: median |error| 8.3 % (1B, untied;
    its own 13.2 %), 5.6 % (8B; 10.0 %), 7.1 % (3B, untied; 14.0 %); Spearman 0.94, 0.97, 0.94.
    The compiled members are priced 1-21 % slow, the block's compiled rate (above)."""
    for name, file in EARLIER.items():
        grid = json.loads((DATA / f"{file}.json").read_text())
        rows = [r for r in grid["rows"] if r["status"] == "ok"]
        seconds = [r["step_s"] for r in rows]
        predicted = [predict_step(member(r, grid), PROFILE, cuda=True).step_s for r in rows]
        # issue 38's step-time targets: median |error| <= 10 %, Spearman >= 0.9
        assert statistics.median(errors(predicted, seconds)) <= 0.10, name
        assert rank_correlation(predicted, seconds) >= 0.9, name
        for r, p in zip(rows, predicted):
            if "compile=true" in r["layout"]:
                assert 0.0 < p / r["step_s"] - 1 < 0.22, (name, r["layout"])


def test_compiled_float8_under_ac_costs_less_than_priced_on_every_grid():
    """Over the same member without AC, on all four H200 grids, from this profile's plan: compiled
    bf16's selective and full AC priced within 1-7 points of what they cost; compiled float8's
    (tensorwise and rowwise) 8-14 points high: selective measured -1 to +5 %, priced +11-14 %;
    full +9-14 %, priced +21-25 % (BENCHMARKS.md). Not modelled yet: when it is, this says by how much."""
    grids = [GRID, *(json.loads((DATA / f"{file}.json").read_text()) for file in EARLIER.values())]
    for grid in grids:
        rows = {r["layout"].removeprefix("single, "): r for r in grid["rows"] if r["status"] == "ok"}
        for precision in ("bf16", "float8", "float8_rowwise"):
            plain = rows[f"AC none, compile=true, {precision}"]
            for ac in ("selective", "full"):
                row = rows.get(f"AC {ac}, compile=true, {precision}")
                if row is None:  # the 8B's rowwise with selective AC stopped at a non-finite loss
                    continue
                measured = row["step_s"] / plain["step_s"] - 1
                priced = (predict_step(member(row, grid), PROFILE, cuda=True).step_s
                          / predict_step(member(plain, grid), PROFILE, cuda=True).step_s - 1)
                high = priced - measured
                assert (0.0 <= high <= 0.075) if precision == "bf16" else (0.08 <= high <= 0.15), (
                    grid["date"], precision, ac, measured, priced)
