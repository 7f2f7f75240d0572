"""Checkpoint cost on this machine, in one run.

    python -m benchmarks.bench_checkpoint [--model llama3_100m]

1. HSDP 2x2 save policies: `checkpoint.hsdp_save_replicas=all` (every rank writes; DCP spreads
   the de-duplicated replicated shards over them) vs `first` (only the first replica group
   writes): files, bytes, largest file, save seconds. Both hold the same tensors.
2. Synchronous vs async saving under FSDP 2: how long training waited for checkpoints
   (`checkpoint_blocking_s` in the summary) per save, and the training time of the run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import run_job
from titan_exp.checkpoint import complete_steps


def job(model: str, steps: int, *extra: str) -> list[str]:
    return [f"model={model}", f"training.steps={steps}", "training.seq_len=128", "training.global_batch_size=4",
            "lr_scheduler.warmup_steps=0",
            "metrics.log_freq=1", "checkpoint=default", "checkpoint.interval=1", "checkpoint.keep_latest_k=0", *extra]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3_100m")
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()

    print("| hsdp_save_replicas | files | total MiB | largest file MiB | save s |\n|---|---|---|---|---|")
    for policy in ("all", "first"):
        with tempfile.TemporaryDirectory() as run_dir:
            code, s = run_job(job(args.model, 1, "parallelism=hsdp", "training.local_batch_size=1",
                                  f"checkpoint.hsdp_save_replicas={policy}"), Path(run_dir))
            assert code == 0, s
            marker = complete_steps(Path(run_dir) / "checkpoints")[1]
        sizes = [size for size, _ in marker["files"].values()]
        print(f"| {policy} | {len(sizes)} | {sum(sizes) / 2**20:.1f} | {max(sizes) / 2**20:.1f} "
              f"| {marker['save_s']:.2f} |")

    print("\n| async_mode | saves | training waited per save, s | train time s |\n|---|---|---|---|")
    for mode in ("disabled", "async"):
        with tempfile.TemporaryDirectory() as run_dir:
            code, s = run_job(job(args.model, args.saves, "parallelism=fsdp", "cluster.nproc_per_node=2",
                                  "training.local_batch_size=2", f"checkpoint.async_mode={mode}"), Path(run_dir))
            assert code == 0, s
        print(f"| {mode} | {args.saves} | {s['checkpoint_blocking_s'] / args.saves:.2f} | {s['train_time_s']:.1f} |")


if __name__ == "__main__":
    main()
