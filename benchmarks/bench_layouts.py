"""Every layout of the debug model at world size 1, 2, 4 and 8, measured in one run.

    python -m benchmarks.bench_layouts [--steps 10] [--out layouts.md]

Each layout runs through the launcher with local processes (gloo on CPU), the same global batch
(16 x 128 tokens) and seed. Prints a markdown table: steady-state tokens/s per device, peak
memory of the largest rank (RSS on CPU), parameter+gradient+optimizer bytes of the largest rank
and their ratio to one process (FSDP-N should be 1/N), and the final loss (the same everywhere).
On a 2-core machine every rank beyond the second shares a core: tokens/s per device falls with
world size for that reason alone; compare layouts at equal world size.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import run_job

# name: degrees (pp, dp_replicate, dp_shard, cp, tp; 1 if absent) and pipeline schedule if any.
LAYOUTS = {
    "single": dict(),
    "fsdp2": dict(dp_shard=2),
    "ddp2": dict(dp_replicate=2),
    "tp2": dict(tp=2),
    "pp2 1F1B": dict(pp=2),
    "pp2 Interleaved1F1B": dict(pp=2, schedule="Interleaved1F1B"),
    "cp2": dict(cp=2),
    "fsdp4": dict(dp_shard=4),
    "hsdp 2x2": dict(dp_replicate=2, dp_shard=2),
    "tp4": dict(tp=4),
    "fsdp2 x tp2": dict(dp_shard=2, tp=2),
    "pp2 x fsdp2": dict(pp=2, dp_shard=2),
    "pp2 x tp2": dict(pp=2, tp=2),
    "pp4 1F1B": dict(pp=4),
    "fsdp2 x cp2": dict(dp_shard=2, cp=2),
    "fsdp8": dict(dp_shard=8),
    "hsdp 2x4": dict(dp_replicate=2, dp_shard=4),
    "fsdp4 x tp2": dict(dp_shard=4, tp=2),
    "pp2 x fsdp4": dict(pp=2, dp_shard=4),
    "pp2 x fsdp2 x tp2 (3d)": dict(pp=2, dp_shard=2, tp=2),
    "fsdp4 x cp2": dict(dp_shard=4, cp=2),
}
GLOBAL_BATCH, SEQ_LEN = 16, 128


def overrides(layout: dict, steps: int) -> list[str]:
    pp, rep, shard, cp, tp = (layout.get(k, 1) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    return [
        f"parallelism.context_parallel_degree={cp}",
        f"parallelism.pipeline_parallel_degree={pp}",
        f"parallelism.data_parallel_replicate_degree={rep}",
        f"parallelism.data_parallel_shard_degree={shard}",
        f"parallelism.tensor_parallel_degree={tp}",
        f"parallelism.pipeline_parallel_schedule={layout.get('schedule', '1F1B')}",
        f"training.local_batch_size={GLOBAL_BATCH // (rep * shard)}",
        f"training.global_batch_size={GLOBAL_BATCH}",
        f"training.seq_len={SEQ_LEN}",
        f"training.steps={steps}",
        "metrics.warmup_steps=3",
        f"metrics.log_freq={steps}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="layout names to run (default: all)")
    args = parser.parse_args()
    rows, base_state = [], None
    for name, layout in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            code, s = run_job(overrides(layout, args.steps), Path(run_dir))
        if code != 0:
            rows.append(f"| {name} | - | - | - | - | - | - | {s.get('status')}: {s.get('error', '')[:80]} |")
            continue
        base_state = base_state or s["state_bytes_per_rank"]
        rows.append(
            f"| {name} | {s['world_size']} | {s['tokens_per_second_per_device']:.0f} | {s['mfu']:.1f} | "
            f"{s['peak_memory_gib']:.2f} | {s['state_bytes_per_rank'] / 2**20:.1f} | "
            f"{s['state_bytes_per_rank'] / base_state:.3f} | {s['final_loss']:.5f} |"
        )
        print(rows[-1], flush=True)
    print("\n| layout | world | tokens/s/device | MFU % | peak RSS GiB (max rank) | params+grads+optim MiB "
          "(max rank) | vs single | final loss |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
