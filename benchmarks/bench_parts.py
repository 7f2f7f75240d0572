"""The GPU model's parts against XLA's published microbenchmarks (issue 36): GEMMs by shape and
NCCL's collectives by size and group, as a spec sheet's plan prices them, beside what XLA measured.

    python -m benchmarks.bench_parts
    python -m benchmarks.bench_parts --from-xla MATMUL_HEADER COLLECTIVE_HEADER   # rewrite the data

The measurements are XLA's performance tables (openxla/xla, xla/service/gpu/model/
matmul_interpolator_data.h and collective_interpolator_data.h, at e97611c4c41c, 2026-02-13), which
its cost model reads: GEMMs (m x k) @ (k x n) in batches of b, each side 256-4,096, on H100 ("sm_90")
and B200 ("sm_100_B200"), in bf16, TF32 and float8 (e4m3 x e4m3); and all-gather, reduce-scatter,
all-reduce and all-to-all in fp32 on the 8 NVLink-connected GPUs of an H100 and a B200 node (groups
of 2-8, 1 KiB to 2 GiB) and on GB200 NVL72 ("sm_100_GB200") and GB300 NVL72 ("sm_103") (groups of
4-72, up to 32 GiB), their throughput the buffer's bytes over XLA's median time (the all-gather's
output, the reduce-scatter's input: collective_perf_table_gen.cc). benchmarks/data/xla_gemm.csv and
xla_collectives.csv hold them (`--from-xla` writes them from the two headers).

A part is priced as a spec sheet's plan prices it: a GEMM by perf.model.block.gemm_s (the best shape at
[mamf]'s share of the peak, its wave utilization, or its bytes at HBM speed), b batched GEMMs as
one of b x m rows (the table's 4 x 1,024 and 1 x 4,096 agree within 2 %); a collective by the spec
profile's line for it (perf.rates.devices: NVLink's bandwidth at the share NCCL's topology model gives a
link, NCCL's latency model). Errors are predicted rate over measured, less 1: above 0, the part is priced too fast.
Nothing here is fitted; no part was changed for these numbers (XLA's GEMM table in place of the wave
model and its NVLink bus shares in place of NCCL's 0.8, tried on 2026-11-29, were not kept:
BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.common import REPO
from titan_exp.perf.model.block import gemm_s
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.kernels import spec_kernels

DATA = REPO / "benchmarks" / "data"
GEMMS, COLLECTIVES = DATA / "xla_gemm.csv", DATA / "xla_collectives.csv"
# XLA's table keys and the spec sheet each is priced on, with its NVLink domain (GPUs a group may span).
GPUS = {"sm_90": ("h100", 8), "sm_100_B200": ("b200", 8), "sm_100_GB200": ("gb200", 72), "sm_103": ("gb300", 72)}
DTYPES = {"bf16xbf16->bf16": "bfloat16", "f32xf32->f32": "float32", "f8e4m3fnxf8e4m3fn->bf16": "float8"}
OPS = {"all-gather": "all_gather", "reduce-scatter": "reduce_scatter", "all-reduce": "all_reduce",
       "all-to-all": "all_to_all"}
# A collective's band by its bytes: latency-bound below 1 MiB, bandwidth-bound from 64 MiB (a Llama 3
# 8B's activations on 8,192 tokens in bf16; a block's weights are larger), ramping between.
SIZE_BANDS = ((2**20, "< 1 MiB"), (64 * 2**20, "1-64 MiB"), (math.inf, ">= 64 MiB"))
# FLOPs: a GEMM at least this large (Llama 3 8B's w1 at TP 8 on 8,192 tokens is 120e9) is
# priced in its own band, its few microseconds of fixed cost a small share of its time.
BIG = 64e9
BIG_BAND = f">= {BIG / 1e9:.0f} GFLOP"


def _devices(text: str) -> dict[str, str]:
    """A header's text protobuf by device key."""
    parts = re.split(r'\n    key: "([^"]+)"', text)
    return dict(zip(parts[1::2], parts[2::2]))


def from_xla(matmul: Path, collective: Path) -> None:
    """Write xla_gemm.csv and xla_collectives.csv from XLA's two headers."""
    entry = re.compile(r"entries \{\s*b: (\d+)\s*m: (\d+)\s*n: (\d+)\s*k: (\d+)\s*((?:flops \{[^}]*\}\s*)+)\}")
    with GEMMS.open("w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["xla_gpu", "b", "m", "n", "k", "dtype", "tflops"])
        for gpu, body in _devices(matmul.read_text()).items():
            for *bmnk, flops in entry.findall(body):
                for key, value in re.findall(r'key: "([^"]+)" value: (\d+)', flops):
                    if gpu in GPUS and key in DTYPES:
                        out.writerow([gpu, *bmnk, DTYPES[key], f"{int(value) / 1e12:.4g}"])
    collective_entry = re.compile(r'opcode: "([^"]+)"\s*shape \{\s*element_type: F32\s*((?:dimensions: \d+\s*)+).*?'
                                  r"num_replica_groups: (\d+)\s*num_devices_per_group: (\d+).*?"
                                  r"network_throughput_bytes_per_sec: (\d+)", re.S)
    with COLLECTIVES.open("w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["xla_gpu", "op", "bytes", "groups", "group_size", "gb_s"])
        for gpu, body in _devices(collective.read_text()).items():
            for op, dims, groups, size, rate in collective_entry.findall(body):
                if gpu in GPUS and op in OPS:
                    elements = 1
                    for d in re.findall(r"\d+", dims):
                        elements *= int(d)
                    scattered = int(size) if op == "reduce-scatter" else 1  # its shape is the output, a 1/g
                    out.writerow([gpu, OPS[op], 4 * elements * scattered, groups, size, f"{int(rate) / 1e9:.4g}"])


def read(path: Path) -> list[dict[str, str]]:
    """One of the two tables, its rows as dicts."""
    with path.open() as f:
        return list(csv.DictReader(f))


def above_peak(gemms: list[dict[str, str]]) -> set[tuple[str, str]]:
    """(XLA GPU, dtype) tables whose best measured rate exceeds the spec sheet's dense peak: not a
    measurement a part can be checked against (H100's float8, 2,593 TFLOP/s at its best against a
    1,979 peak)."""
    best: dict[tuple[str, str], float] = defaultdict(float)
    for r in gemms:
        best[r["xla_gpu"], r["dtype"]] = max(best[r["xla_gpu"], r["dtype"]], float(r["tflops"]))
    return {(gpu, dtype) for (gpu, dtype), tflops in best.items()
            if tflops > SPECS[GPUS[gpu][0]].peaks()[dtype]}


def gemm_errors(gemms: list[dict[str, str]]) -> dict[tuple[str, str, str], list[float]]:
    """(spec, dtype, band) -> predicted over measured rate, less 1, for every XLA GEMM of a table
    not above its peak; band "every shape", and BIG_BAND for those of at least BIG FLOPs."""
    kernels = {gpu: spec_kernels(SPECS[spec]) for gpu, (spec, _) in GPUS.items()}
    out: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    left_out = above_peak(gemms)
    for r in gemms:
        if (r["xla_gpu"], r["dtype"]) in left_out:
            continue
        b, m, n, k = (int(r[c]) for c in "bmnk")
        spec, kern = GPUS[r["xla_gpu"]][0], kernels[r["xla_gpu"]]
        predicted = 2 * b * m * n * k / gemm_s(kern, b * m, n, k, r["dtype"]) / 1e12
        error = predicted / float(r["tflops"]) - 1
        out[spec, r["dtype"], "every shape"].append(error)
        if 2 * b * m * n * k >= BIG:
            out[spec, r["dtype"], BIG_BAND].append(error)
    return out


def collective_errors(collectives: list[dict[str, str]]) -> dict[tuple[str, str, str], list[float]]:
    """(spec, op, band) -> predicted over measured throughput, less 1, for every XLA collective;
    band by its size (SIZE_BANDS' label)."""
    profiles, out = {}, defaultdict(list)
    for r in collectives:
        spec, domain = GPUS[r["xla_gpu"]]
        world = int(r["groups"]) * int(r["group_size"])
        if (spec, world) not in profiles:
            profiles[spec, world] = spec_profile(SPECS[spec], world, domain)
        size = int(r["bytes"])
        seconds = profiles[spec, world].collective(r["op"], int(r["group_size"]))(size)
        band = next(label for below, label in SIZE_BANDS if size < below)
        out[spec, r["op"], band].append(size / seconds / 1e9 / float(r["gb_s"]) - 1)
    return out


def summary(errors: list[float]) -> str:
    return (f"{len(errors)} | {100 * statistics.median(errors):+.0f} % | "
            f"{100 * statistics.median(map(abs, errors)):.0f} % "
            f"| {100 * min(errors):+.0f} % to {100 * max(errors):+.0f} %")


def bands(errors: dict[tuple[str, str, str], list[float]], band: str, what: str) -> str:
    """One band's errors over every spec sheet and kind: how many, the median error, the median |error|."""
    every = [e for (_, _, b), es in errors.items() if b == band for e in es]
    return (f"{what} ({len(every)}) {100 * statistics.median(every):+.0f} % at the median, |error| "
            f"{100 * statistics.median(map(abs, every)):.0f} %")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-xla", nargs=2, type=Path, metavar=("MATMUL_HEADER", "COLLECTIVE_HEADER"),
                        help="rewrite benchmarks/data/xla_*.csv from XLA's two headers, then score")
    args = parser.parse_args(argv)
    if args.from_xla:
        from_xla(*args.from_xla)
    gemm_rows = read(GEMMS)
    gemms, collectives = gemm_errors(gemm_rows), collective_errors(read(COLLECTIVES))
    print("| GEMMs: spec sheet | dtype | shapes | measured | median error | median abs error | range |")
    print("|---|---|---|---|---|---|---|")
    for (spec, dtype, band), errors in sorted(gemms.items(), key=lambda kv: (*kv[0][:2], kv[0][2] == BIG_BAND)):
        print(f"| {spec} | {dtype} | {band} | {summary(errors)} |")
    for gpu, dtype in sorted(above_peak(gemm_rows)):
        spec = GPUS[gpu][0]
        print(f"Left out: {spec}'s {dtype} GEMMs, XLA's best above the spec sheet's dense peak "
              f"({SPECS[spec].peaks()[dtype]:,.0f} TFLOP/s)")
    print()
    print("| collectives: spec sheet | op | sizes | measured | median error | median abs error | range |")
    print("|---|---|---|---|---|---|---|")
    order = {label: i for i, (_, label) in enumerate(SIZE_BANDS)}
    for (spec, op, band), errors in sorted(collectives.items(), key=lambda kv: (*kv[0][:2], order[kv[0][2]])):
        print(f"| {spec} | {op} | {band} | {summary(errors)} |")
    print(f"\nparts against XLA's tables: {bands(gemms, BIG_BAND, 'GEMMs of 64 GFLOP or more')}; "
          f"{bands(collectives, SIZE_BANDS[-1][1], 'collectives of 64 MiB or more')}; "
          f"{bands(gemms, 'every shape', 'every GEMM')}; "
          f"{bands(collectives, SIZE_BANDS[0][1], 'collectives under 1 MiB')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
