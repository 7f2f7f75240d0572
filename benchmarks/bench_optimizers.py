"""What optimizer=muon costs against AdamW: the debug model's step time in one process and under
FSDP 2 on local CPU ranks, and the Newton-Schulz FLOPs Muon adds to a step.

    python -m benchmarks.bench_optimizers [--steps 10] [--repeats 2]

Each row is the median over `--repeats` runs, interleaved (adamw, muon, adamw, ...) so drift on a
shared machine hits every row alike, of the median steady step (summary.json's tokens/s). Muon's
extra work is its Newton-Schulz iterations, 5 x (4 m^2 n + 2 m^3) FLOPs for an m x n matrix (m <= n),
which every rank does for every matrix (titan_exp.train.muon), and under FSDP one all-gather of each
matrix's update; the model's own FLOPs a step are printed beside them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import run_job
from titan_exp import targets
from titan_exp.config import compose_job
from titan_exp.train import muon

LAYOUTS = {"1 process": [], "FSDP 2": ["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"]}
OPTIMIZERS = {"adamw": ["optimizer=adamw"], "muon": ["optimizer=muon"]}


def newton_schulz_flops(overrides: list[str]) -> float:
    """FLOPs of one step's Newton-Schulz over every matrix of the model (one rank's, all of them)."""
    job = compose_job(overrides)
    with torch.device("meta"):
        model = targets.build(job, "model", job.model)
    flops = 0.0
    for name, p in model.named_parameters():
        if muon.is_matrix(name, p.shape):
            m, n = sorted(p.shape[-2:])
            flops += (p.shape[0] if p.ndim == 3 else 1) * muon.NS_STEPS * (4 * m * m * n + 2 * m ** 3)
    return flops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    common = [f"training.steps={args.steps}", "training.seq_len=64", "training.global_batch_size=8",
              "metrics.warmup_steps=3", "metrics.log_freq=5"]
    step_s: dict[tuple[str, str], list[float]] = {}
    model_flops = 0.0  # a step's, all ranks together (summary.json's flops_per_token x tokens)
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for layout, lo in LAYOUTS.items():
                for optimizer, oo in OPTIMIZERS.items():
                    code, s = run_job([*common, *lo, *oo], Path(tmp) / f"{r}-{layout}-{optimizer}")
                    assert code == 0, s and s.get("error")
                    tokens = s["global_batch_size"] * s["seq_len"] / s["world_size"]
                    step_s.setdefault((layout, optimizer), []).append(tokens / s["tokens_per_second_per_device"])
                    model_flops = s["flops_per_token"] * s["global_batch_size"] * s["seq_len"]
    print(f"Newton-Schulz a step: {newton_schulz_flops(common) / 1e9:.1f} GFLOP on every rank; "
          f"the model's forward and backward: {model_flops / 1e9:.1f} GFLOP over all ranks")
    print("| layout | AdamW step (s) | Muon step (s) | Muon / AdamW |")
    print("| --- | --- | --- | --- |")
    for layout in LAYOUTS:
        adamw, mu = (statistics.median(step_s[(layout, o)]) for o in OPTIMIZERS)
        print(f"| {layout} | {adamw:.3f} | {mu:.3f} | {mu / adamw:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
