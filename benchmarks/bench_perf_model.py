"""The performance and memory models against measurements: every valid layout, predicted vs
measured tokens/s per device and peak memory, in one run.

    python -m benchmarks.bench_perf_model                    # the four cases of issue 13
    python -m benchmarks.bench_perf_model --case debug:4     # one case
    python -m benchmarks.bench_perf_model --held-out         # the memory model's held-out cases
    python -m benchmarks.bench_perf_model --case dim512-L12:2 # one of them (memory only)
    python -m benchmarks.bench_perf_model --threshold-mib 1  # peak RSS close to memory in use
    python -m benchmarks.bench_perf_model --rescore          # memory model vs the recorded GiB, no runs

For each (model, world) it calibrates the machine (reusing the cached profile unless --refresh;
not for a held-out case, whose memory prediction reads no profile),
plans every valid layout, runs each for a few steps (the first `metrics.warmup_steps` excluded),
and prints a table plus Spearman's rank correlation of tokens/s and the median |error|. A case
with ROUNDS > 1 runs every layout once a round, round after round, and takes each layout's median:
a slow spell of the machine then lands on one run of every layout, not on a few layouts' only run.
Targets (issue 13): Spearman >= 0.85, median |tokens/s error| <= 20 %, memory within +-10 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, run_job
from titan_exp.config import compose_job
from titan_exp.perf.calibration.fit import median_abs, relative_errors, spearman
from titan_exp.perf.rates.profile import this_machine
from titan_exp.perf.search.planner import plan

# By default the runs are measured as a user runs them: cluster.cpu_malloc_mmap_threshold_mib at its
# default (16 MiB). --threshold-mib 1 makes the peak RSS track memory in use (glibc's heap keeps the
# freed buffers under the threshold: +0.1 to +0.55 GiB on the 100M model's FSDP, CP and TP layouts at
# 16 MiB), but every buffer over 1 MiB is then mapped afresh each step, and its page faults cost 5-21 %
# of the 100M model's throughput by layout (BENCHMARKS.md). The memory model predicts the resident
# set at the job's threshold (memory in use plus the heap's hold on FSDP's per-block buffers under
# it); the performance model, with the page faults over it, the default's speed.
COMMON = ["metrics.log_freq=100", "lr_scheduler.warmup_steps=1"]
CASES = {
    "debug:4": (["model=debugmodel", "training.seq_len=128", "training.global_batch_size=16",
                 "training.local_batch_size=16", "training.steps=8", "metrics.warmup_steps=3"], 4),
    "debug:8": (["model=debugmodel", "training.seq_len=128", "training.global_batch_size=16",
                 "training.local_batch_size=16", "training.steps=8", "metrics.warmup_steps=3"], 8),
    "100m:2": (["model=llama3_100m", "training.seq_len=256", "training.global_batch_size=4",
                "training.local_batch_size=4", "training.steps=7", "metrics.warmup_steps=2"], 2),
    "100m:4": (["model=llama3_100m", "training.seq_len=256", "training.global_batch_size=4",
                "training.local_batch_size=4", "training.steps=7", "metrics.warmup_steps=2"], 4),
}
# Rounds of runs per case (--rounds overrides). 100M at world 2 has five layouts, the fastest three
# within 9 % of each other, and one layout measured 100, 109 and 115 tokens/s in three runs on
# 2026-11-23: one run each ranks them by the machine's mood. Three rounds cost 9 more minutes.
ROUNDS = {"100m:2": 3}
# Memory only, on a shape and world size the memory model was not built on (named before measuring).
HELD_OUT = {
    "dim384-L4:2": (["model=debugmodel", "model.dim=384", "model.n_layers=4", "model.n_heads=12", "model.n_kv_heads=4",
                     "training.seq_len=256", "training.global_batch_size=8", "training.local_batch_size=8",
                     "training.steps=3", "metrics.warmup_steps=1"], 2),
    # Named 2026-11-23, after the memory model's issue 19 revision and before it was measured.
    "dim512-L6:4": (["model=debugmodel", "model.dim=512", "model.n_layers=6", "model.n_heads=8", "model.n_kv_heads=4",
                     "training.seq_len=192", "training.global_batch_size=8", "training.local_batch_size=8",
                     "training.steps=3", "metrics.warmup_steps=1"], 4),
    # Named 2026-11-23 (issue 13), after the CPU heap term (HEAP_FSDP_BLOCKS) was fitted and before
    # this shape was measured: its blocks' flat buffers (17.7 MB) are just over 16 MiB, and under it at tp 2.
    "dim640-L8:4": (["model=debugmodel", "model.dim=640", "model.n_layers=8", "model.n_heads=20", "model.n_kv_heads=4",
                     "training.seq_len=256", "training.global_batch_size=8", "training.local_batch_size=8",
                     "training.steps=3", "metrics.warmup_steps=1"], 4),
    # Named 2026-11-23 (issue 13), after the heap term became every block's flat buffers plus one
    # block's weights (perf.model.memory.heap_slack) and before this shape was measured: 12 blocks whose
    # flat buffers (13 MiB) are all under 16 MiB, so the heap holds 0.41 GiB of its FSDP layouts' 1.85.
    "dim512-L12:2": (["model=debugmodel", "model.dim=512", "model.n_layers=12", "model.n_heads=8", "model.n_kv_heads=8",
                      "training.seq_len=256", "training.global_batch_size=8", "training.local_batch_size=8",
                      "training.steps=3", "metrics.warmup_steps=1"], 2),
    # Named 2026-11-24 (issue 13), after the TP heap term (perf.model.memory.sp_heap_slack) was fitted on
    # dry runs of six shapes at tp 2 and 4 and before this shape was measured: a new dim, depth and
    # sequence length, and a world size (3) no case has used, so TP runs at a degree (3) outside the fit.
    "dim576-L9:3": (["model=debugmodel", "model.dim=576", "model.n_layers=9", "model.n_heads=9", "model.n_kv_heads=3",
                     "training.seq_len=384", "training.global_batch_size=6", "training.local_batch_size=6",
                     "training.steps=3", "metrics.warmup_steps=1"], 3),
}


def calibrate(overrides: list[str], world: int, refresh: bool) -> None:
    cmd = ([sys.executable, "-m", "titan_exp.perf.calibrate", *overrides, "--world", str(world)]
           + (["--refresh"] if refresh else []))
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(base: list[str], pl, world: int) -> dict:
    """One run of a planned layout: tokens/s per device, peak GiB, wall seconds, status."""
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.time()
        code, s = run_job([*base, *pl.overrides, f"cluster.nproc_per_node={world}"], Path(run_dir))
    return {"tps": s.get("tokens_per_second_per_device") if code == 0 and s else None,
            "gib": s.get("peak_memory_gib") if s else None, "wall_s": time.time() - start,
            "status": s.get("status") if s else "no summary"}


def run_case(name: str, overrides: list[str], world: int, refresh: bool, memory_only: bool = False,
             threshold_mib: int | None = None, rounds: int = 1) -> dict:
    base = [*overrides, *COMMON] + ([] if threshold_mib is None
                                    else [f"cluster.cpu_malloc_mmap_threshold_mib={threshold_mib}"])
    if not memory_only:  # the memory model reads no profile
        calibrate(base, world, refresh)
    profile = this_machine(world)
    plans = plan(compose_job(base), world, device_memory_gib=1e9, profile=profile)
    runs: dict[str, list[dict]] = {pl.name: [] for pl in plans}
    for r in range(rounds):
        for pl in plans:
            run = measure(base, pl, world)
            runs[pl.name].append(run)
            shown = f"{run['tps']:.0f}" if run["tps"] else run["status"]
            print(f"  {name} {pl.name}{f' (round {r + 1})' if rounds > 1 else ''}: predicted {pl.tokens_per_s:.0f}, "
                  f"measured {shown} tokens/s/device; memory {pl.memory_gib:.2f} vs "
                  f"{run['gib'] or float('nan'):.2f} GiB",
                  flush=True)
    rows = []
    for pl in plans:
        done = [run for run in runs[pl.name] if run["tps"]]
        rows.append({"layout": pl.name, "local_batch": pl.local_batch_size, "predicted_tps": pl.tokens_per_s,
                     "measured_tps": statistics.median(run["tps"] for run in done) if done else None,
                     "predicted_gib": pl.memory_gib,
                     "measured_gib": (statistics.median(run["gib"] for run in done) if done
                                      else runs[pl.name][-1]["gib"]),
                     "wall_s": sum(run["wall_s"] for run in runs[pl.name]),
                     "runs_tps": [run["tps"] for run in runs[pl.name]],
                     "breakdown": pl.step.breakdown(), "status": runs[pl.name][-1]["status"]})
    ok = [r for r in rows if r["measured_tps"]]
    # The profile itself goes with the results, so a later change to the model can be re-scored on
    # this run's measurements (MachineProfile.from_dict) after the cached one is recalibrated.
    result = {"case": name, "world": world, "profile": "none read: memory only" if memory_only else profile.name,
              "profile_data": profile.to_dict(),
              "rounds": rounds, "rows": rows,
              "memory_errors": relative_errors([r["predicted_gib"] for r in ok], [r["measured_gib"] for r in ok])}
    if not memory_only:
        result["spearman"] = spearman([r["predicted_tps"] for r in ok], [r["measured_tps"] for r in ok])
        result["tps_errors"] = relative_errors([r["predicted_tps"] for r in ok], [r["measured_tps"] for r in ok])
    return result


def markdown(result: dict, memory_only: bool = False) -> str:
    rounds = result.get("rounds", 1)
    lines = [f"### {result['case']} (world {result['world']}, profile {result['profile']}"
             f"{f', median of {rounds} rounds (range)' if rounds > 1 else ''})", ""]
    if memory_only:
        lines += ["| layout | predicted GiB | measured GiB | error |", "|---|---|---|---|"]
    else:
        lines += ["| layout | predicted tok/s/dev | measured tok/s/dev | error | predicted GiB | measured GiB | error "
                  "| model: compute / comm / bubble / recompute s |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: -(r["measured_tps"] or 0)):
        if not r["measured_tps"]:
            lines.append(f"| {r['layout']} | {r['predicted_tps']:.0f} | {r['status']} | | | | | |")
            continue
        merr = r["predicted_gib"] / r["measured_gib"] - 1
        if memory_only:
            lines.append(f"| {r['layout']} | {r['predicted_gib']:.2f} | {r['measured_gib']:.2f} | {merr:+.1%} |")
            continue
        b = r["breakdown"]
        spread = [x for x in r.get("runs_tps", []) if x]
        measured = f"{r['measured_tps']:.0f}" + (f" ({min(spread):.0f}-{max(spread):.0f})" if len(spread) > 1 else "")
        lines.append(f"| {r['layout']} | {r['predicted_tps']:.0f} | {measured} "
                     f"| {r['predicted_tps'] / r['measured_tps'] - 1:+.1%} | {r['predicted_gib']:.2f} "
                     f"| {r['measured_gib']:.2f} | {merr:+.1%} | {b['compute']:.3f} / {b['exposed_comm']:.3f} / "
                     f"{b['bubble']:.3f} / {b['recompute']:.3f} |")
    mem = result["memory_errors"]
    lines.append("")
    if not mem:
        lines.append("no layout ran: the rows' status says why")
    elif not memory_only:
        lines.append(f"Spearman {result['spearman']:.2f}; "
                     f"median |tokens/s error| {median_abs(result['tps_errors']):.1%}; "
                     f"memory: median |error| {median_abs(mem):.1%}, worst {max(mem, key=abs):+.1%}")
    else:
        lines.append(f"memory: median |error| {median_abs(mem):.1%}, worst {max(mem, key=abs):+.1%}")
    return "\n".join(lines) + "\n"


def recorded_memory(name: str, rows: list[dict[str, str]]) -> dict[str, float]:
    """The measured GiB per layout in the newest recorded table of a case: of its rows in
    benchmarks/data/perf_model_cpu.csv that have a measured GiB, those of the latest date and start."""
    mine = [r for r in rows if r["case"] == name and r["measured_gib"]]
    newest = max((r["date"], r["start"]) for r in mine)
    return {r["layout"]: float(r["measured_gib"]) for r in mine if (r["date"], r["start"]) == newest}


def rescore(names: list[str]) -> None:
    """The memory model as it is now against the recorded measurements of each case
    (benchmarks/data/perf_model_cpu.csv): a change to the model is re-scored on every earlier
    run's rows without running them again."""
    import csv

    with (REPO / "benchmarks" / "data" / "perf_model_cpu.csv").open(newline="") as f:
        recorded = list(csv.DictReader(f))
    for name in names:
        overrides, world = (CASES | HELD_OUT)[name]
        measured = recorded_memory(name, recorded)
        plans = plan(compose_job([*overrides, *COMMON]), world, device_memory_gib=1e9)
        errors = {pl.name: pl.memory_gib / measured[pl.name] - 1 for pl in plans if pl.name in measured}
        worst = max(errors, key=lambda k: abs(errors[k]))
        print(f"{name}: {len(errors)} rows, {sum(abs(e) <= 0.1 for e in errors.values())} within 10 %, "
              f"median |error| {median_abs(list(errors.values())):.1%}, worst {errors[worst]:+.1%} ({worst})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", choices=sorted(CASES | HELD_OUT),
                        help="default: the four cases (a held-out case measures memory only)")
    parser.add_argument("--held-out", action="store_true", help="every held-out case, memory only")
    parser.add_argument("--refresh", action="store_true", help="recalibrate")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--rounds", type=int, default=None,
                        help="runs of every layout, round after round (default: ROUNDS, else 1)")
    parser.add_argument("--threshold-mib", type=int, default=None,
                        help="cluster.cpu_malloc_mmap_threshold_mib of every run (default: the config's, 16)")
    parser.add_argument("--rescore", action="store_true",
                        help="no runs: the memory model against benchmarks/data/perf_model_cpu.csv's measured GiB")
    args = parser.parse_args()
    if args.rescore:
        return rescore(args.case or [*CASES, *HELD_OUT])
    chosen = {k: (CASES | HELD_OUT)[k] for k in args.case} if args.case else HELD_OUT if args.held_out else CASES
    results = []
    for name, (overrides, world) in chosen.items():
        memory_only = name in HELD_OUT
        result = run_case(name, overrides, world, args.refresh, memory_only=memory_only,
                          threshold_mib=args.threshold_mib, rounds=args.rounds or ROUNDS.get(name, 1))
        results.append(result)
        print(markdown(result, memory_only=memory_only), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
