"""Expert parallel 1, 2 and 4 of the debug MoE against the dense debugmodel of equal active
parameters, on 4 local ranks under FSDP, and under FSDP 2 x TP 2 with and without EP, measured
in one run (issues 18 and 36).

    python -m benchmarks.bench_moe [--steps 12] [--seq-len 256] [--repeats 2]

moe_debug and debugmodel share attention, vocabulary and depth; a token goes through a SwiGLU of
width 768 in both (2 routed experts + 1 shared expert of 256 in moe_debug's MoE layers), so the
FLOPs per token differ only by the routers. The MoE holds ~2x the parameters. Each row is the
median of `--repeats` runs, interleaved (dense, ep1, ep2, ep4, dense, ...), so drift on this noisy
machine hits every row alike: tokens/s per device (steady state), peak memory per rank (resident
high-water mark of the largest rank: on a CPU most of it is the runtime) and the parameter +
gradient + optimizer bytes each rank holds, beside the planner's predictions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import run_job
from titan_exp.config import compose_job

TP2 = ["parallelism.data_parallel_shard_degree=2", "parallelism.tensor_parallel_degree=2",
       "training.local_batch_size=4"]  # the same global batch of 8, no accumulation
ROWS = {
    "dense debugmodel, FSDP 4": ["model=debugmodel"],
    "moe_debug, FSDP 4 (EP 1)": ["model=moe_debug"],
    "moe_debug, FSDP 4 x EP 2": ["model=moe_debug", "parallelism.expert_parallel_degree=2"],
    "moe_debug, FSDP 4 x EP 4": ["model=moe_debug", "parallelism.expert_parallel_degree=4"],
    # TP without EP splits each routed expert's width; EP 4 spreads over FSDP 2 x TP 2 instead
    "moe_debug, FSDP 2 x TP 2": ["model=moe_debug", *TP2],
    "moe_debug, FSDP 2 x TP 2 x EP 4": ["model=moe_debug", *TP2, "parallelism.expert_parallel_degree=4"],
}


def main(argv: list[str] | None = None) -> int:
    from titan_exp.perf.model.memory import predict_memory
    from titan_exp.perf.model.step import predict_step
    from titan_exp.perf.rates.profile import this_machine

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    common = ["parallelism=fsdp", "cluster.nproc_per_node=4", f"training.steps={args.steps}",
              f"training.seq_len={args.seq_len}", "training.global_batch_size=8", "training.local_batch_size=2",
              "metrics.warmup_steps=3", "metrics.log_freq=4"]
    results: dict[str, list[dict]] = {name: [] for name in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, (name, overrides) in enumerate(ROWS.items()):
                code, summary = run_job([*common, *overrides], Path(tmp) / f"{r}-{i}")
                assert code == 0, summary and summary.get("error")
                results[name].append(summary)
    profile = this_machine(4)
    print(f"4 ranks (gloo, this CPU), seq {args.seq_len}, global batch 8, {args.steps} steps, median of "
          f"{args.repeats} interleaved runs; predictions from {profile.name} ({profile.source})\n")
    print("| run | params (active) | tokens/s/device | vs dense | predicted | peak GiB/rank | predicted "
          "| state MiB/rank | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    dense = None
    for name, overrides in ROWS.items():
        runs = results[name]
        job = compose_job([*common, *overrides])
        tps = statistics.median(s["tokens_per_second_per_device"] for s in runs)
        dense = dense or tps
        peak = statistics.median(s["peak_memory_gib"] for s in runs)
        state = statistics.median(s["state_bytes_per_rank"] for s in runs) / 2**20
        m = job.model
        print(f"| {name} | {m.num_params / 1e6:.1f}M ({m.active_params / 1e6:.1f}M) | {tps:,.0f} | {tps / dense:.2f} "
              f"| {predict_step(job, profile).tokens_per_s_per_device:,.0f} | {peak:.2f} "
              f"| {predict_memory(job)['total']:.2f} | {state:.1f} | {runs[-1]['final_loss']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
