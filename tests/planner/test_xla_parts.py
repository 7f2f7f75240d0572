"""benchmarks/bench_parts.py: XLA's measured GEMMs and collectives, as read from its tables into
benchmarks/data, beside what a spec sheet's parts price them at."""

from __future__ import annotations

import pytest
from conftest import REPO

from benchmarks import bench_parts as bench
from titan_exp.perf.model.block import gemm_s
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.kernels import spec_kernels


def test_the_parts_agree_with_xla_where_they_are_known_to_hold():
    """Which checks the reading and the units: H100's largest bf16 GEMM (4 x 4,096 rows by 4,096 by
    4,096, 789 TFLOP/s measured) within 5 %; GB200's largest all-gather over 8 GPUs (767 GB/s)
    within 10 %."""
    gemms, collectives = bench.read(bench.GEMMS), bench.read(bench.COLLECTIVES)
    gemm = next(r for r in gemms if r["xla_gpu"] == "sm_90" and r["dtype"] == "bfloat16"
                and (r["b"], r["m"], r["n"], r["k"]) == ("4", "4096", "4096", "4096"))
    rows, side = 4 * 4096, 4096
    priced = 2 * rows * side * side / gemm_s(spec_kernels(SPECS["h100"]), rows, side, side, "bfloat16") / 1e12
    assert float(gemm["tflops"]) == pytest.approx(789, abs=1) and priced == pytest.approx(789, rel=0.05)
    gather = max((r for r in collectives if r["xla_gpu"] == "sm_100_GB200" and r["op"] == "all_gather"
                  and (r["groups"], r["group_size"]) == ("9", "8")), key=lambda r: int(r["bytes"]))
    size = int(gather["bytes"])
    priced = size / spec_profile(SPECS["gb200"], 72, 72).collective("all_gather", 8)(size) / 1e9
    assert float(gather["gb_s"]) == pytest.approx(767, abs=1) and priced == pytest.approx(767, rel=0.10)


def test_every_spec_sheet_and_kind_is_scored_and_benchmarks_md_shows_the_summary(capsys):
    gemms, collectives = bench.read(bench.GEMMS), bench.read(bench.COLLECTIVES)
    assert bench.above_peak(gemms) == {("sm_90", "float8")}  # 2,593 TFLOP/s at its best: left out
    assert set(bench.gemm_errors(gemms)) == {(spec, dtype, band) for spec in ("h100", "b200")
                                             for dtype in ("bfloat16", "float32", "float8")
                                             for band in ("every shape", bench.BIG_BAND)} - {
        ("h100", "float8", "every shape"), ("h100", "float8", bench.BIG_BAND)}
    assert set(bench.collective_errors(collectives)) == {(spec, op, band) for spec in ("h100", "b200", "gb200", "gb300")
                                                         for op in bench.OPS.values() for _, band in bench.SIZE_BANDS}
    assert bench.main([]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    shown = " ".join((REPO / "BENCHMARKS.md").read_text().split())  # lines wrap there
    assert last.startswith("parts against XLA's tables: ") and " ".join(last.split()) in shown
