"""Measure this machine (or the cluster's nodes) for the performance model.

    python -m titan_exp.perf.calibrate [overrides ...] [--world N] [--refresh] [--compile]
    python -m titan_exp.perf.calibrate model=llama3_100m --world 4
    python -m titan_exp.perf.calibrate model=llama3_8b cluster=slurm cluster.nnodes=2 cluster.nproc_per_node=8

Overrides are launch.py's: the model (its GEMM and block shapes are measured), the sequence
length, and the cluster, whose executor starts the calibration ranks exactly as it would start
training ranks (`cluster=slurm` measures the cluster's nodes; pass cluster.wait=true to wait for
the profile). The profile lands in `<cache>/perf/<machine>.json` (titan_exp.perf.rates.profile); a later
run for the same machine, world size and model reuses it unless `--refresh`. On a CPU a model not
measured before on a known machine adds its blocks to the profile; a GPU's profile holds its kernel
rates, from which every model's blocks are priced (titan_exp.perf.model.block), so one calibration covers
every model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from titan_exp.config import Executor, compose_job
from titan_exp.perf.calibration.run import calibration_job, run_calibration
from titan_exp.perf.calibration.timing import Options
from titan_exp.perf.model.shapes import tp_degrees
from titan_exp.perf.rates.profile import Kernels, MachineProfile, model_shape, profiles_dir, this_machine
from titan_exp.record import RunDir
from titan_exp.validation import validate


def kernels_line(k: Kernels) -> str:
    """The kernel rates a GPU's plan prices blocks it has not measured at (perf.model.block)."""
    curve = lambda c: ", ".join(f"{s} {r:.3g}" for s, r in c)  # noqa: E731
    compiled = (f", {k.host_compiled_s * 1e6:.1f} us/compiled kernel" if "host_compiled_s" in k.measured
                else " (compiled kernel not measured: calibrate --compile)")
    grouped = f"{k.grouped_gemm_share:.2f} of the dense rate" if "grouped_gemm_share" in k.measured else "not measured"
    float8 = (f", torchao's Python {k.host_float8_s * 1e3:.2f} ms/eager float8 linear" if "host_float8_s" in k.measured
              else " (eager float8 linear not measured)")
    return ("kernels: matmul TFLOP/s (best shape, full waves) "
            + ", ".join(f"{d} {r:.3g}" for d, r in k.matmul_tflops.items())
            + f"; attention ({k.attention_kernel}) TFLOP/s by sequence (head dim {k.head_dim}) "
            f"forward {curve(k.attention_fwd)}, "
            f"backward {curve(k.attention_bwd)}; memory-bound {k.memory_tb_s * 1e3:.0f} GB/s"
            + "".join(f", the block's {mode} {r * 1e3:.0f}" for mode, r in k.elementwise_tb_s.items())
            + f"; host {k.host_eager_s * 1e6:.1f} us/op{compiled}{float8}; grouped GEMM {grouped}"
            + ("; torchao's float8 casts GB/s "
               + ", ".join(f"{key} {r * 1e3:.0f}" for key, r in k.float8_cast_tb_s.items())
               if k.float8_cast_tb_s else ""))


def print_table(profile: MachineProfile, shape: str) -> None:
    print(f"machine profile {profile.name} ({profile.source}, {profile.calibration_s:.0f} s of measuring)")
    print(f"  ranks computing at full speed at once: {profile.concurrency:.2f}; "
          f"collective hidden behind compute: {profile.overlap:.0%}")
    for dtype, line in profile.gemm.items():
        rows = profile.gemm_shapes.get(dtype, [])
        rates = ", ".join(f"{m}x{k}x{n} {2 * m * k * n / s / 1e12:.3f}" for m, k, n, s in rows[-3:])
        # A line with no slope: the sizes measured were too small to show one above the noise.
        rate = f"{1 / line.per_unit_s / 1e12:.3f} TFLOP/s" if line.per_unit_s > 0 else "no trend by size (noise)"
        print(f"  matmul {dtype}: {rate} + {line.latency_s * 1e6:.0f} us"
              f"{'; largest shapes (TFLOP/s): ' + rates if rates else ''}")
    for tp, cost in sorted(profile.blocks.get(shape, {}).items()):
        print(f"  block tp={tp}: fwd {cost.fwd.per_unit_s * 1e3:.2f} ms/seq, "
              f"fwd+bwd {cost.fwd_bwd.per_unit_s * 1e3:.2f} ms/seq (+{cost.fwd_bwd.latency_s * 1e3:.2f} ms), "
              f"head {cost.head.per_unit_s * 1e3:.2f} ms/seq"
              + (f"; optimizer phase {cost.update.per_unit_s * 1e3:.1f} ms/block + {cost.update.latency_s * 1e3:.1f} ms"
                 if cost.update else ""))
    for where, table in (("", profile.collectives), (" across nodes", profile.inter_node)):
        for op, by_g in table.items():
            cells = ", ".join(f"{g} ranks {line.latency_s * 1e6:.0f} us"
                              + (f" + {1 / line.per_unit_s / 1e9:.2f} GB/s" if line.per_unit_s > 0 else "")
                              for g, line in sorted(by_g.items()))
            print(f"  {op}{where}: {cells}")
    if profile.kernels:
        print("  " + kernels_line(profile.kernels))
    print(f"  AdamW: {profile.optimizer_s_per_param * 1e9:.2f} ns/param"
          + (f"; fresh pages {1 / profile.fresh_memory_s_per_byte / 1e9:.2f} GB/s"
             if profile.fresh_memory_s_per_byte else "")
          + (f"; compiled block {profile.compile_speedup:.2f}x eager" if profile.compile_speedup else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_exp.perf.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py (model=..., cluster=...)")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks to calibrate (default: the overrides' world size)")
    parser.add_argument("--refresh", action="store_true", help="measure again even if a profile exists")
    parser.add_argument("--compile", action="store_true", help="also measure the compiled block's speed-up (slow)")
    parser.add_argument("--tiny", action="store_true", help="smallest sizes and fewest repeats (tests)")
    parser.add_argument("--profile-dir", default=None, help="where profiles live (default: <cache>/perf)")
    parser.add_argument("--run-dir", default=None,
                        help="the calibration job's run dir (default: under the profile dir)")
    args = parser.parse_intermixed_args(argv)  # overrides and flags in any order
    job = calibration_job(compose_job(args.overrides), args.world)
    errors = validate(job)
    if errors:
        print("calibrate: refused, nothing was started:\n  - " + "\n  - ".join(errors), file=sys.stderr)
        return 2
    shape, folder = model_shape(job), Path(args.profile_dir) if args.profile_dir else None
    local = job.cluster.executor != Executor.slurm
    if local and not args.refresh:  # this machine: reuse without starting any rank
        known = this_machine(job.world_size, folder=folder, nodes=job.cluster.nnodes)
        if known.source == "calibrated" and not known.missing(job, tp_degrees(job.model, job.world_size),
                                                              compile=args.compile):
            print(f"reusing {known.path(folder)} (--refresh measures again)")
            print_table(known, shape)
            return 0
    run_dir = RunDir(args.run_dir or (folder or profiles_dir()) / "runs" / time.strftime("%Y%m%d-%H%M%S"))
    options = Options(refresh=args.refresh, tiny=args.tiny, compile=args.compile,
                      profile_dir=str(folder.resolve()) if folder else None)
    print(f"calibrating {job.world_size} rank(s) with the {job.cluster.executor} executor; run dir {run_dir.path}")
    profile, error = run_calibration(job, options, run_dir)
    if error == "queued":
        print(f"queued; the profile is written by the job (see {run_dir.path}/summary.json)")
        return 0
    if profile is None:
        print(f"calibrate: failed: {error}", file=sys.stderr)
        return 1
    print_table(profile, shape)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
