"""The planner's memory model against measured peak memory, on this machine.

    python -m benchmarks.bench_plan [--world 4] [overrides ...]

Runs every layout `titan_exp.perf.plan` finds valid for the model (default: llama3_100m, batch 4 x 256
tokens, 3 steps), plus AC variants of FSDP, and prints predicted vs measured peak memory per device
(the most loaded rank: RSS on CPU) and the error. Target: within +-15 %.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import run_job
from titan_exp.config import compose_job
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.search.layouts import layout_overrides, valid_layouts

BASE = ["model=llama3_100m", "training.seq_len=256", "training.local_batch_size=2", "training.global_batch_size=4",
        "training.steps=3", "metrics.log_freq=3", "lr_scheduler.warmup_steps=1",
        "cluster.cpu_malloc_mmap_threshold_mib=1"]  # RSS then tracks memory in use (BENCHMARKS.md)
EXTRA = [["activation_checkpoint.mode=full"], ["activation_checkpoint.mode=selective"],
         ["parallelism.fsdp_reshard_after_forward=never"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = [*BASE, *args.overrides]
    cases = [[*layout_overrides(job), f"cluster.nproc_per_node={args.world}"]
             for job in valid_layouts(compose_job(base), args.world)]
    fsdp = [c for c in cases if f"parallelism.data_parallel_shard_degree={args.world}" in c]
    cases += [[*fsdp[0], *extra] for extra in EXTRA] if fsdp else []
    cases.append(["cluster.nproc_per_node=1", "parallelism.data_parallel_shard_degree=1"])
    print("| layout | predicted GiB | measured GiB | error |\n|---|---|---|---|")
    errors = []
    for case in cases:
        overrides = [*base, *case]
        predicted = predict_memory(compose_job(overrides))["total"]
        with tempfile.TemporaryDirectory() as run_dir:
            code, s = run_job(overrides, Path(run_dir))
        name = " ".join(o.split(".")[-1] for o in case if not o.endswith("=1") and "nproc" not in o) or "single"
        if code != 0:
            print(f"| {name} | {predicted:.2f} | {s.get('status')}: {s.get('error', '')[:60]} | |")
            continue
        err = predicted / s["peak_memory_gib"] - 1
        errors.append(abs(err))
        print(f"| {name} | {predicted:.2f} | {s['peak_memory_gib']:.2f} | {err:+.1%} |", flush=True)
    print(f"\n{len(errors)} layouts, max |error| {max(errors):.1%}, mean |error| {sum(errors) / len(errors):.1%}")


if __name__ == "__main__":
    main()
