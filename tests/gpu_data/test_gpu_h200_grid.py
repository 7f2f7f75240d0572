"""The grids on one H200 (issue 38): every single-GPU member autotune considers (AC x compile x
bf16 / float8 tensorwise / rowwise at one sequence of 8192), measured beside the planner's
predictions from the profile calibrated in the same session and from the spec sheet. The 1B's
(benchmarks/data/gpu_h200_grid.json, 2026-11-27) was the held-out check named on 2026-11-26; the
8B's cut to 8 layers (gpu_h200_grid_8b.json, 2026-11-28) the one named on 2026-11-27; the 3B's
(gpu_h200_grid_3b.json, 2026-11-28) the one named after the 8B's (BENCHMARKS.md). The 1B and the
3B ran with an untied output (conftest.as_ran): their rows are predicted as that model. Measured,
none is held out any more, and a change of the model that moves these numbers says so where it is
recorded. Checked here on any machine."""

from __future__ import annotations

import functools
import gzip
import json
import statistics

import pytest
from conftest import REPO, as_ran, errors, job_config, rank_correlation

from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import gpu_work_by_kind, predict_step
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.profile import MachineProfile
from titan_exp.train.trace import gpu_summary
from titan_exp.validation import resolve

DATA = REPO / "benchmarks" / "data"
GRIDS = {name: json.loads((DATA / f"{file}.json").read_text())
         for name, file in (("1b", "gpu_h200_grid"), ("8b", "gpu_h200_grid_8b"), ("3b", "gpu_h200_grid_3b"))}
PROFILES = {name: MachineProfile.from_dict(json.loads((DATA / grid["profile"]).read_text()))
            for name, grid in GRIDS.items()}
GRID, PROFILE = GRIDS["1b"], PROFILES["1b"]
ROWS = GRID["rows"]
SPEC = spec_profile(SPECS["h200"], 1, 1)


def measured(grid: str) -> list[dict]:
    """The members of a grid that ran to the end (the 8B's float8 rowwise + compile with selective
    AC stopped at a non-finite loss at its second step: the row says so)."""
    return [r for r in GRIDS[grid]["rows"] if r["status"] == "ok"]


def job_of(row: dict, grid: str = "1b"):
    return _job(grid, row["name"])


@functools.cache  # resolving a member's job composes its config: once each
def _job(grid: str, name: str):
    row = next(r for r in GRIDS[grid]["rows"] if r["name"] == name)
    return resolve(job_config([*GRIDS[grid]["base"].split(), *row["overrides"], *as_ran(GRIDS[grid])]))


def step_times(profile, grid: str = "1b") -> list[float]:
    return [predict_step(job_of(r, grid), profile, cuda=True).step_s for r in measured(grid)]


def test_the_planner_ranks_the_grid_and_its_first_choice_measures_near_the_best():
    """Issue 38's ranking target, met on the GPU from both profiles: Spearman >= 0.9 on tokens/s.
    The member the calibrated plan ranks first (float8 tensorwise + compile, AC none) measured
    within 3 % of the grid's best, as autotune's winner did. Median |error|: the calibrated
    profile's 17 % on the GPU, 14 % since autocast's casts are priced (2026-11-28); the spec
    sheet's, 8 % there (its fitted compute_scale makes up for parts not priced), 11 % since, 12.1 %
    with compute_scale refit on the published fitting set after pipelines were priced as a flow shop."""
    assert len(ROWS) == 18 and all(r["status"] == "ok" for r in ROWS)
    seconds = [r["step_s"] for r in ROWS]
    calibrated, spec = step_times(PROFILE), step_times(SPEC)
    for predicted in (calibrated, spec):
        assert rank_correlation(predicted, seconds) >= 0.9
    first = min(range(len(ROWS)), key=lambda i: calibrated[i])
    assert ROWS[first]["tokens_per_second"] >= 0.97 * max(r["tokens_per_second"] for r in ROWS)
    assert statistics.median(errors(spec, seconds)) <= 0.125
    assert statistics.median(errors(calibrated, seconds)) <= 0.15


def test_the_memory_the_planner_counts_is_what_the_grid_allocated():
    """The tensors perf.model.memory_gpu counts, for the model that ran (an untied output, as_ran): over
    the allocated peak on every member, by 1-10 % (median 4.6 %; 1-12 %, median 7.6 %, before
    float8's blocks lost the compiled bf16 block's CUDA_EXTRA, 2026-11-28). While the planner took
    it for the tied 1B, its count was within 3 % on 15 of the 18: two of the account's values, inferred from
    2026-11-25's runs of the same untied models, made up for the untied matrix's states."""
    over = []
    for r in ROWS:
        parts = predict_memory(job_of(r), cuda=True)
        over.append((parts["total"] - parts["rounding"] - parts["workspaces"]) / r["peak_allocated_gib"] - 1)
    assert 0.0 < min(over) and max(over) < 0.10 and 0.04 < statistics.median(over) < 0.05


@pytest.mark.xfail(strict=True, reason="issue 38's targets, missed on the H200 (2026-11-27): tokens/s median |error| "
                                       "13 % from the calibrated profile (17 % then); the reserved peak missed by "
                                       "10.1 % on the 2 eager float8 members with full AC (as ran; 6 of 18 then)")
def test_issue_38s_targets_on_the_grid():
    assert statistics.median(errors(step_times(PROFILE), [r["step_s"] for r in ROWS])) <= 0.10
    for r in ROWS:
        assert abs(predict_memory(job_of(r), cuda=True)["total"] / r["peak_memory_gib"] - 1) <= 0.10, r["name"]


def test_a_gpu_plan_with_eager_selective_ac_says_it_is_optimistic():
    """The grid's eager selective-AC members measured 26-38 % slower than predicted, host-bound
    (its per-op policy in Python); their plans say so, and no other member's does."""
    for r in ROWS:
        notes = predict_step(job_of(r), PROFILE, cuda=True).notes
        eager_selective = "AC selective, compile=false" in r["name"]
        assert any(n.startswith("selective AC without compile") for n in notes) == eager_selective, r["name"]


# -- the 8B cut to 8 layers, 2026-11-28 ---------------------------------------------------------

def test_the_8b_grid_is_ranked_and_its_memory_predicted_within_issue_38s_targets():
    """The check named on 2026-11-27, before it ran: 17 of the 18 members measured. Spearman on
    tokens/s >= 0.9 from the calibrated profile (0.98 on the GPU) and from the spec sheet (0.97);
    the member the calibrated plan ranks first is the grid's best; the predicted peak memory within
    10 % of what the allocator reserved (with expandable segments) on every member (8 % at worst),
    where on the 1B's grid, before expandable segments, 6 of 18 were not."""
    rows = measured("8b")
    assert len(rows) == 17 and len(GRIDS["8b"]["rows"]) == 18
    seconds = [r["step_s"] for r in rows]
    calibrated, spec = step_times(PROFILES["8b"], "8b"), step_times(SPEC, "8b")
    for predicted in (calibrated, spec):
        assert rank_correlation(predicted, seconds) >= 0.9
    first = rows[min(range(len(rows)), key=lambda i: calibrated[i])]
    assert first["tokens_per_second"] == max(r["tokens_per_second"] for r in rows)
    for r in rows:
        assert abs(predict_memory(job_of(r, "8b"), cuda=True)["total"] / r["peak_memory_gib"] - 1) <= 0.10, r["name"]


def test_the_8b_grids_tokens_per_second_in_sample_since_autocast_is_priced():
    """Held out, the grid missed issue 38's tokens/s target: median |error| 14.3 % from the
    calibrated profile, every member predicted fast. Since autocast's casts and fp32 stream are
    priced (chosen from these members' traces, nothing fitted), 9.9 %, worst 20 %, the float8
    members still fast: within the target in sample only, which the next grid has to confirm."""
    seconds = [r["step_s"] for r in measured("8b")]
    predicted = step_times(PROFILES["8b"], "8b")
    assert statistics.median(errors(predicted, seconds)) <= 0.10 and max(errors(predicted, seconds)) <= 0.21
    assert all(p < m for p, m in zip(predicted, seconds))


# The 3B's steps traced on the H200 (gpu_suite.py, `, traced`), by the configuration each ran.
TRACES = {"gpu_h200_trace_llama3_3b_bf16_compile": ("2026-11-25", ["compile.enable=true", "precision=bf16"]),
          "gpu_h200_trace_llama3_3b_float8_compile": ("2026-11-27", ["compile.enable=true", "precision=float8"]),
          "gpu_h200_trace_llama3_3b_bf16_eager_selective": ("2026-11-28", ["activation_checkpoint.mode=selective",
                                                                           "precision=bf16"]),
          "gpu_h200_trace_llama3_3b_float8_rowwise_compile": ("2026-11-28", ["compile.enable=true",
                                                                             "precision=float8_rowwise"]),
          "gpu_h200_trace_llama3_3b_bf16_eager": ("2026-11-28", ["precision=bf16"]),
          "gpu_h200_trace_llama3_3b_float8_eager": ("2026-11-28", ["precision=float8"])}


@functools.cache
def traced(name: str) -> dict:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        path.write_bytes(gzip.decompress((DATA / f"{name}.json.gz").read_bytes()))
        return gpu_summary(path)


def predicted_kinds(name: str) -> dict[str, float]:
    job = resolve(job_config(["model=llama3_3b", "training.seq_len=8192", "training.local_batch_size=1",
                              "training.global_batch_size=1", *TRACES[name][1], *as_ran(GRIDS["8b"])]))
    return {k: v * 1e3 for k, v in gpu_work_by_kind(job, PROFILES["8b"]).items()}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_traced_steps_attention_gemms_and_optimizer_are_what_the_calibrated_plan_prices(name):
    """Each kind of the 3B's traced step's device work (train.trace.gpu_summary) beside what the
    plan from the profile calibrated on 2026-11-28 prices it at (perf.model.step.gpu_work_by_kind):
    attention within 10 % (cuDNN's, at the rates calibration measured), the optimizer phase within
    4 % (fused AdamW and the gradient norm over the parameters of the untied model that ran: 33-34
    ms traced and priced; 30 ms priced for the tied model the planner took it for), bf16's GEMMs within
    10 % and float8's priced 20-25 % slow (the float8 GEMM rate calibration measured, 1,224 TFLOP/s,
    is below what the model's own GEMMs ran at)."""
    here, there = predicted_kinds(name), traced(name)["busy_by_kind_ms"]
    assert here["attention"] == pytest.approx(there["attention"], rel=0.10)
    assert here["optimizer"] == pytest.approx(there["optimizer"], rel=0.04)
    if "float8" in name:
        assert 1.15 < here["gemm"] / there["gemm"] < 1.3
    else:
        assert here["gemm"] == pytest.approx(there["gemm"], rel=0.10)


def test_the_eager_3b_steps_named_before_they_ran():
    """The 3B's eager bf16 and eager float8 tensorwise steps, traced after autocast's casts were
    priced, their predictions from the 8B's profile written down before they ran (the rows'
    `named_prediction`, which the planner still gives). Step time: bf16 11 % fast, float8 25 %
    fast; memory within 5 % of the reserved peak. By kind: their memory-bound kernels priced 25 %
    (bf16) and 36 % (float8: torchao's eager casts) under what the trace shows; the GPU busy 96-98 %
    of the step, not waiting on its host, eager float8 included."""
    rows = {r["config"]: r for r in GRIDS["8b"]["suite_rows"] if "named_prediction" in r}
    for config, trace, fast, memory_bound in (("bf16 eager, traced", "gpu_h200_trace_llama3_3b_bf16_eager", 0.11, 0.25),
                                              ("float8 tensorwise, traced", "gpu_h200_trace_llama3_3b_float8_eager",
                                               0.25, 0.36)):
        row, named = rows[config], rows[config]["named_prediction"]
        named_as = ["model=llama3_3b", "training.seq_len=8192", "training.local_batch_size=1",
                    "training.global_batch_size=1", *TRACES[trace][1]]
        # named for the tied 3B the config describes; it ran untied (as_ran), 0.9 % slower as now predicted
        assert predict_step(resolve(job_config(named_as)), PROFILES["8b"], cuda=True).step_s == pytest.approx(
            named["step_s"], abs=1e-3)
        job = resolve(job_config([*named_as, *as_ran(GRIDS["8b"])]))
        kinds = gpu_work_by_kind(resolve(job_config(named_as)), PROFILES["8b"])
        assert {k: v * 1e3 for k, v in kinds.items()} == pytest.approx(named["by_kind_ms"], abs=0.1)
        assert 1 - named["step_s"] / row["step_s"] == pytest.approx(fast, abs=0.01)
        assert abs(predict_memory(job, cuda=True)["total"] / row["peak_memory_gib"] - 1) <= 0.05
        there = traced(trace)
        assert 1 - named["by_kind_ms"]["memory_bound"] / there["busy_by_kind_ms"]["memory_bound"] == pytest.approx(
            memory_bound, abs=0.01)
        assert there["busy_s"] / there["window_s"] > 0.95


# -- the 3B, 2026-11-28 ----------------------------------------------------------------------------

def test_the_3b_grid_named_before_it_ran():
    """The check named after the 8B's grid, before it ran: all 18 members measured (14 in the
    session's first call, 4 and autotune in a second), each with the prediction the planner gave
    there from the profile calibrated in the same call, which it still gives for the model the grid
    named (the tied 3B). Ranked: Spearman 0.96 (target 0.9), the first choice the best. Tokens/s:
    median |error| 14.9 %, worst 34 % (target 10 %), missed; bf16's members within 10 %, float8's
    5-34 % fast. Predicted as the untied model that ran: 14.0 %, 33.9 %."""
    grid, rows = GRIDS["3b"], measured("3b")
    assert len(rows) == 18
    seconds = [r["step_s"] for r in rows]
    named = [predict_step(resolve(job_config([*grid["base"].split(), *r["overrides"]])), PROFILES["3b"],
                          cuda=True).step_s for r in rows]
    assert named == pytest.approx([r["predicted_step_s"] for r in rows], rel=1e-9)
    assert rank_correlation(named, seconds) >= 0.9  # the ranking target, met
    assert 0.10 < statistics.median(errors(named, seconds)) <= 0.15  # the tokens/s target (10 %), missed
    first = rows[min(range(len(rows)), key=lambda i: named[i])]
    assert first["tokens_per_second"] == max(r["tokens_per_second"] for r in rows)
    as_ran = step_times(PROFILES["3b"], "3b")
    assert statistics.median(errors(as_ran, seconds)) <= 0.15
    for r, p in zip(rows, as_ran):
        if "bf16" in r["name"]:
            assert abs(p / r["step_s"] - 1) <= 0.10, r["name"]
        else:
            assert -0.34 < p / r["step_s"] - 1 < -0.05, r["name"]


def test_the_3b_grids_memory_as_it_ran():
    """Issue 38's memory target: on the GPU, for the tied model it took the grid for, the planner
    was within 10 % of the reserved peak on 13 of 18 members (worst -17 %); for the untied model
    that ran, on 17 of 18, the miss the eager float8 member with full AC (-10.8 %), whose
    allocator reserved 10.2 GiB over its allocated peak."""
    rows = measured("3b")
    misses = [r["name"] for r in rows if abs(predict_memory(job_of(r, "3b"), cuda=True)["total"]
                                             / r["peak_memory_gib"] - 1) > 0.10]
    assert misses == ["single, AC full, compile=false, float8 [local batch 1]"]


def test_the_3b_compiled_steps_traced_again_by_kind():
    """The named re-trace of the 3B's bf16 and float8 tensorwise + compile steps, their work by kind
    beside this release's prices for the untied model that ran: bf16 GEMMs, attention and the
    optimizer phase within 10 %; float8's GEMMs priced 13 % slow (calibration's float8 rate, 1,217
    TFLOP/s, below the 1,550 the model's forward GEMMs ran at); its memory-bound work priced at
    under half what it took (the compiled casts, perf.rates.float8_casts). The steps repeat their
    earlier traces (2026-11-25 and 2026-11-27) within 2 % a kind."""
    rows = {r["config"]: r for r in GRIDS["3b"]["suite_rows"]}
    for config, overrides, earlier in (("bf16 + compile, traced", ["precision=bf16"],
                                        "gpu_h200_trace_llama3_3b_bf16_compile"),
                                       ("float8 tensorwise + compile, traced", ["precision=float8"],
                                        "gpu_h200_trace_llama3_3b_float8_compile")):
        there = rows[config]["trace"]["busy_by_kind_ms"]
        job = resolve(job_config(["model=llama3_3b", "training.seq_len=8192", "training.local_batch_size=1",
                                  "training.global_batch_size=1", "compile.enable=true", *overrides,
                                  *as_ran(GRIDS["3b"])]))
        here = {k: v * 1e3 for k, v in gpu_work_by_kind(job, PROFILES["3b"]).items()}
        assert here["attention"] == pytest.approx(there["attention"], rel=0.10)
        assert here["optimizer"] == pytest.approx(there["optimizer"], rel=0.10)
        if config.startswith("bf16"):
            assert here["gemm"] == pytest.approx(there["gemm"], rel=0.10)
        else:
            assert 1.1 < here["gemm"] / there["gemm"] < 1.2 and here["memory_bound"] / there["memory_bound"] < 0.5
        assert there == pytest.approx(traced(earlier)["busy_by_kind_ms"], rel=0.02)


def test_the_traced_memory_bound_kernels_ran_slower_than_a_contiguous_add():
    """BENCHMARKS.md (the memory-bound kernels in the recorded traces, 2026-11-28): each traced 3B
    step's memory-bound work beside what the 3B grid's calibrated profile prices it at, the
    model's bytes at the rate of the calibration's contiguous add (the profile measured no rate of
    the block's own, Kernels.elementwise_tb_s): the bf16 steps at 0.74-0.79 of it, 283 of 371 ms
    together; the float8 steps' casts, at that rate too, 0.40-0.64."""
    assert not PROFILES["3b"].kernels.elementwise_tb_s
    share, priced, took = {}, {}, {}
    for name, (_, overrides) in TRACES.items():
        job = resolve(job_config(["model=llama3_3b", "training.seq_len=8192", "training.local_batch_size=1",
                                  "training.global_batch_size=1", *overrides, *as_ran(GRIDS["8b"])]))
        priced[name] = gpu_work_by_kind(job, PROFILES["3b"])["memory_bound"] * 1e3
        took[name] = traced(name)["busy_by_kind_ms"]["memory_bound"]
        share[name.removeprefix("gpu_h200_trace_llama3_3b_")] = round(priced[name] / took[name], 2)
    assert share == {"bf16_eager": 0.74, "bf16_eager_selective": 0.78, "bf16_compile": 0.79,
                     "float8_eager": 0.64, "float8_compile": 0.45, "float8_rowwise_compile": 0.40}
    bf16 = [n for n in TRACES if "bf16" in n]
    assert (sum(priced[n] for n in bf16) == pytest.approx(283, abs=1)
            and sum(took[n] for n in bf16) == pytest.approx(371, abs=1))
    # Priced at the bf16 steps' share of the add's rate (in sample; no profile has it): the grids'
    # calibrated median |error| 13.2 -> 11.2 % (1B), 14.0 -> 11.3 % (3B), 10.0 -> 7.4 % (8B),
    # Spearman unchanged or up.
    import dataclasses

    for grid, before, after in (("1b", 0.132, 0.112), ("3b", 0.140, 0.113), ("8b", 0.100, 0.074)):
        k, seconds = PROFILES[grid].kernels, [r["step_s"] for r in measured(grid)]
        shared = dataclasses.replace(PROFILES[grid], kernels=dataclasses.replace(
            k, elementwise_tb_s={"eager": 0.764 * k.memory_tb_s, "compiled": 0.764 * k.memory_tb_s}))
        assert statistics.median(errors(step_times(PROFILES[grid], grid), seconds)) == pytest.approx(before, abs=0.001)
        assert statistics.median(errors(step_times(shared, grid), seconds)) == pytest.approx(after, abs=0.001)
        ranked = [rank_correlation(step_times(profile, grid), seconds)
                  for profile in (PROFILES[grid], shared)]
        assert ranked[1] >= ranked[0]  # Spearman unchanged or up


def test_torchaos_shape_filter_named_before_it_ran():
    """Named 2026-11-28 before any GPU ran it (BENCHMARKS.md, the held-out checks): the 1B's float8
    rowwise + compile member (AC none), as the grid ran it, and the same member with torchao's
    float8 shape filter (precision.filter_fqns's auto_filter_small_kn: all linears but w1 and w3
    in bf16), predicted from the 1B grid's calibrated profile. The plan has the filter 2.7 %
    slower; the grid measured that member 11 % slower than bf16 + compile, which torchao's H100
    tables lay to the small shapes the filter keeps in bf16. Measured that evening
    (tests/test_gpu_h200_1b_tied.py): the filter 11.6 % faster; the named order missed."""
    row = next(r for r in ROWS if r["layout"] == "single, AC none, compile=true, float8_rowwise")
    base = [*GRID["base"].split(), *row["overrides"], *as_ran(GRID)]
    without, with_filter = (
        predict_step(resolve(job_config([*base, *extra])), PROFILE, cuda=True).tokens_per_s_per_device
        for extra in ([], ["precision.filter_fqns=[output,auto_filter_small_kn]"]))
    assert (round(without, -1), round(with_filter, -1)) == (60520, 58900)
    assert row["tokens_per_second"] == pytest.approx(45929, abs=1)
