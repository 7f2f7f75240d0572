"""What optimizer=muon costs against AdamW: the debug model's step time and peak memory per rank in
one process, under FSDP 2, TP 2 and FSDP 2 x TP 2 on local CPU ranks, beside the planner's
predictions, and the Newton-Schulz FLOPs Muon adds to a step.

    python -m benchmarks.bench_optimizers [--steps 10] [--repeats 2]

Each measured number is the median over `--repeats` runs, interleaved (adamw, muon, adamw, ...) so
drift on a shared machine hits every row alike, of the median steady step (summary.json's tokens/s)
and the largest rank's peak memory. Predictions are the planner's (perf.model.step.predict_step,
perf.model.memory.predict_memory) with this machine's calibrated CPU profile (python -m
titan_exp.perf.calibrate). Muon's extra work is its Newton-Schulz iterations, which every rank does
for every matrix (titan_exp.train.muon; FLOPs: train.muon.newton_schulz_flops), and under FSDP and TP
one all-gather of each matrix's update.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import run_job
from titan_exp.config import compose_job
from titan_exp.perf.model.shapes import muon_matrices
from titan_exp.train import muon

LAYOUTS = {
    "1 process": ["training.local_batch_size=8"],
    "FSDP 2": ["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"],
    "TP 2": ["parallelism.tensor_parallel_degree=2", "cluster.nproc_per_node=2", "training.local_batch_size=8"],
    "FSDP 2 x TP 2": ["parallelism.data_parallel_shard_degree=2", "parallelism.tensor_parallel_degree=2",
                      "cluster.nproc_per_node=4", "training.local_batch_size=4"],
}
OPTIMIZERS = {"adamw": ["optimizer=adamw"], "muon": ["optimizer=muon"]}


def newton_schulz_flops(overrides: list[str]) -> float:
    """FLOPs of one step's Newton-Schulz on one rank, every matrix of the model whole (as the planner counts them)."""
    m = compose_job(overrides).model
    whole, routed = muon_matrices(m)
    per_block = (sum(c * muon.newton_schulz_flops(k, n) for k, n, c in whole)
                 + m.n_experts * sum(c * muon.newton_schulz_flops(k, n) for k, n, c in routed))
    return m.n_layers * per_block


def measure(common: list[str], repeats: int) -> dict[tuple[str, str], list[dict]]:
    """summary.json of each run, by (layout, optimizer), interleaved over `repeats`."""
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for layout, lo in LAYOUTS.items():
                for optimizer, oo in OPTIMIZERS.items():
                    code, s = run_job([*common, *lo, *oo], Path(tmp) / f"{r}-{layout}-{optimizer}")
                    assert code == 0, s and s.get("error")
                    runs.setdefault((layout, optimizer), []).append(s)
    return runs


def predicted(overrides: list[str]) -> tuple[float, float]:
    """The planner's step seconds and peak GiB per rank for a job, from this machine's CPU profile."""
    from titan_exp.perf.model.memory import predict_memory
    from titan_exp.perf.model.step import predict_step
    from titan_exp.perf.rates.profile import this_machine

    job = compose_job(overrides)
    return predict_step(job, this_machine(job.world_size)).step_s, predict_memory(job)["total"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    common = [f"training.steps={args.steps}", "training.seq_len=64", "training.global_batch_size=8",
              "metrics.warmup_steps=3", "metrics.log_freq=5"]
    runs = measure(common, args.repeats)
    s = next(iter(runs.values()))[0]
    model_flops = s["flops_per_token"] * s["global_batch_size"] * s["seq_len"]  # a step's, all ranks together
    print(f"Newton-Schulz a step: {newton_schulz_flops(common) / 1e9:.1f} GFLOP on every rank; the model's forward "
          f"and backward: {model_flops / 1e9:.1f} GFLOP over all ranks")
    print(f"debugmodel, seq 64, global batch 8, {args.steps} steps, median of {args.repeats} interleaved runs; "
          "measured (predicted)\n")
    print("| layout | AdamW step s | Muon step s | Muon / AdamW | AdamW peak GiB/rank | Muon peak GiB/rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    for layout, lo in LAYOUTS.items():
        step, peak, pred = {}, {}, {}
        for optimizer, oo in OPTIMIZERS.items():
            done = runs[(layout, optimizer)]
            step[optimizer] = statistics.median(r["global_batch_size"] * r["seq_len"] / r["world_size"]
                                                / r["tokens_per_second_per_device"] for r in done)
            peak[optimizer] = statistics.median(r["peak_memory_gib"] for r in done)
            pred[optimizer] = predicted([*common, *lo, *oo])
        print(f"| {layout} | {step['adamw']:.3f} ({pred['adamw'][0]:.3f}) | {step['muon']:.3f} ({pred['muon'][0]:.3f}) "
              f"| {step['muon'] / step['adamw']:.2f}x ({pred['muon'][0] / pred['adamw'][0]:.2f}x) "
              f"| {peak['adamw']:.2f} ({pred['adamw'][1]:.2f}) | {peak['muon']:.2f} ({pred['muon'][1]:.2f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
