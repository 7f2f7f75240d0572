"""What the per-step stop check (titan_exp.signals.stop_requested: one all-reduce of 3 int64
over the world) costs, next to a step of the debug model, on N local gloo ranks.

    python -m benchmarks.bench_stop_check [--ranks 2] [--calls 2000]

Every rank times `calls` stop checks back to back; the launcher then runs the default debug job
on the same ranks and reads its median step time from the summary. Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import REPO


def _rank(rank: int, world: int, port: int, calls: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from titan_exp.signals import stop_requested

    for _ in range(50):
        stop_requested()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        stop_requested()
    seconds = (time.perf_counter() - start) / calls
    if rank == 0:
        Path(out).write_text(json.dumps({"stop_check_s": seconds}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stop.json"
        mp.spawn(_rank, args=(args.ranks, 29000 + os.getpid() % 1000, args.calls, str(out)), nprocs=args.ranks)
        check = json.loads(out.read_text())["stop_check_s"]
        run = Path(tmp) / "run"
        subprocess.run([sys.executable, "launch.py", "parallelism=fsdp", f"cluster.nproc_per_node={args.ranks}",
                        "training.local_batch_size=4", "training.steps=20", f"hydra.run.dir={run}"],
                       cwd=REPO, check=True, capture_output=True)
        summary = json.loads((run / "summary.json").read_text())
    step = summary["train_time_s"] / summary["steps"]
    print(f"{args.ranks} ranks: stop check {check * 1e6:.0f} us, debug-model FSDP step {step * 1e3:.0f} ms "
          f"(mean of 20), check/step {check / step:.2%}")


if __name__ == "__main__":
    main()
