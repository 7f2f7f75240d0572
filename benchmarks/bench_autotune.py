"""Autotune against the exhaustive grid, in one run.

    python -m benchmarks.bench_autotune [--world 4] [--search layout,activation_checkpoint] [--budget 30]
        [--global-batch 16] [--threshold-mib N]

1. `python launch.py -m +sweep=autotune` on the debug model (global batch x 128 tokens per step)
   over the given axes, at the allocator's default threshold unless --threshold-mib (1 measures
   memory in use, and slows the runs: BENCHMARKS.md); its record says the winner and the machine
   time it took. The profile it predicts from is calibrated first if this machine has none (with
   the compiled block's speed-up when compile is searched).
2. Every candidate of the same grid, each run once (warm-up 2 + 8 timed steps), through the
   launcher: the grid's best and its machine time.
Prints the winner's tokens/s as the grid measured it against the grid's best, and the time ratio.
Target (issue 13): within 5 % of the best, in <= 35 % of the grid's machine time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, run_job
from titan_exp.config import compose_job
from titan_exp.perf.autotune import candidates
from titan_exp.perf.rates.profile import this_machine

BASE = ["model=debugmodel", "training.seq_len=128", "metrics.log_freq=100", "lr_scheduler.warmup_steps=1"]
GRID_WARMUP, GRID_STEPS = 2, 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--search", default="layout,activation_checkpoint")
    parser.add_argument("--budget", type=float, default=30.0, help="autotune.budget_minutes")
    parser.add_argument("--global-batch", type=int, default=16,
                        help="sequences per step (also the local batch to start from)")
    parser.add_argument("--threshold-mib", type=int, default=None,
                        help="cluster.cpu_malloc_mmap_threshold_mib (default: unset)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    job = [*BASE, f"training.global_batch_size={args.global_batch}", f"training.local_batch_size={args.global_batch}",
           *([f"cluster.cpu_malloc_mmap_threshold_mib={args.threshold_mib}"] if args.threshold_mib else [])]
    base = [*job, f"cluster.nproc_per_node={args.world}", f"autotune.search=[{args.search}]"]

    # This machine's profile for the model (kept if there is one): what autotune predicts from.
    compile_ = ["--compile"] if "compile" in args.search.split(",") else []
    subprocess.run([sys.executable, "-m", "titan_exp.perf.calibrate", *job, "--world", str(args.world), *compile_],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Path(tmp) / "autotune"
        start = time.perf_counter()
        subprocess.run([sys.executable, "launch.py", "-m", "+sweep=autotune", *base, f"hydra.sweep.dir={sweep}",
                        f"autotune.budget_minutes={args.budget}"], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        autotune_s = time.perf_counter() - start
        record = json.loads((sweep / "autotune.json").read_text())
        report = (sweep / "autotune.md").read_text()
    print(report)

    grid = candidates(compose_job(base), args.world, cuda=False, profile=this_machine(args.world), memory_gib=1e9)
    measured, walls, grid_s = {}, {}, 0.0
    for c in grid:
        with tempfile.TemporaryDirectory() as run_dir:
            start = time.perf_counter()
            code, s = run_job([*base, *c.overrides, f"training.steps={GRID_WARMUP + GRID_STEPS}",
                               f"metrics.warmup_steps={GRID_WARMUP}"], Path(run_dir))
            walls[c.name] = time.perf_counter() - start
            grid_s += walls[c.name]
        measured[c.name] = s["tokens_per_second_per_device"] if code == 0 and s else None
        print(f"  grid {c.name}: {measured[c.name]} ({walls[c.name]:.0f} s)", flush=True)
    ok = {k: v for k, v in measured.items() if v}
    best = max(ok, key=ok.get)
    winner = record["winner"]["name"]
    ratio = ok.get(winner, float("nan")) / ok[best]
    print(f"\nautotune winner {winner}: {ok.get(winner, float('nan')):.0f} tokens/s/device in the grid's own run; "
          f"grid best {best}: {ok[best]:.0f} -> {ratio:.1%} of the best")
    print(f"machine time: autotune {record['spent_s']:.0f} s measuring ({autotune_s:.0f} s wall with its planning), "
          f"grid {grid_s:.0f} s -> {autotune_s / grid_s:.0%}; {len(grid)} candidates")
    if args.out:
        args.out.write_text(json.dumps({"record": record, "grid": measured, "grid_wall_s": walls, "grid_s": grid_s,
                                        "autotune_s": autotune_s, "best": best, "winner_vs_best": ratio},
                                       indent=1, default=str))


if __name__ == "__main__":
    main()
