"""titan_exp vs a bare PyTorch loop: same model, batch, steps, threads and process.

    python -m benchmarks.bench_overhead [--flavor llama3_100m] [--steps 8] [--rounds 2] [titan_exp overrides]
    python -m benchmarks.bench_overhead --flavor debugmodel data.pretokenize=true   # the token store's loader

The bare loop is what a user would write by hand: the same Transformer, AdamW, clipping, a
fixed batch of token ids, nothing else. titan_exp runs the same job through the launcher with
the in-process `debug` executor (so both share this process and its threads), including its
data loader, metrics and sinks. Rounds alternate the two to spread machine noise; the best
steady-state rate (after the warm-up steps) of each is compared. Prints tokens/s, the ratio,
and MFU against the measured fp32 matmul peak.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import run_job
from titan_exp.config import compose_job
from titan_exp.metrics import measure_cpu_peak_tflops
from titan_exp.models.llama import Transformer, flops_per_token


def bare_loop(overrides: list[str], steps: int, warmup: int) -> float:
    job = compose_job(overrides)
    t = job.training
    torch.manual_seed(0)
    model = Transformer(job.model)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, job.model.vocab_size, (t.local_batch_size, t.seq_len + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    elapsed = 0.0
    for step in range(1, steps + 1):
        start = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        loss.item()
        if step > warmup:
            elapsed += time.perf_counter() - start
    return (steps - warmup) * t.local_batch_size * t.seq_len / elapsed


def titan_exp(overrides: list[str], steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        code, summary = run_job(
            [*overrides, "cluster=debug", f"training.steps={steps}", f"metrics.warmup_steps={warmup}",
             f"metrics.log_freq={steps}"],
            Path(run_dir),
        )
    assert code == 0, summary
    return summary["tokens_per_second_per_device"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavor", default="llama3_100m")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("overrides", nargs="*",
                        help="more overrides for the titan_exp runs (e.g. data.pretokenize=true)")
    args = parser.parse_args()
    overrides = [f"model={args.flavor}", f"training.local_batch_size={args.batch}", f"training.seq_len={args.seq_len}"]
    bare, ours = [], []
    for _ in range(args.rounds):
        bare.append(bare_loop(overrides, args.steps, args.warmup))
        ours.append(titan_exp([*overrides, *args.overrides], args.steps, args.warmup))
    job = compose_job(overrides)
    fpt = flops_per_token(job.model, args.seq_len)
    peak = measure_cpu_peak_tflops(torch.float32) * 1e12
    b, o = max(bare), max(ours)
    print(f"{args.flavor} {' '.join(args.overrides)}, batch {args.batch} x {args.seq_len}, "
          f"{torch.get_num_threads()} threads, {args.steps} steps ({args.warmup} warm-up), "
          f"best of {args.rounds} alternating rounds")
    print(f"bare PyTorch loop : {b:10.1f} tokens/s   MFU {100 * b * fpt / peak:5.1f}%   "
          f"rounds {[round(x) for x in bare]}")
    print(f"titan_exp         : {o:10.1f} tokens/s   MFU {100 * o * fpt / peak:5.1f}%   "
          f"rounds {[round(x) for x in ours]}")
    print(f"ratio titan_exp / bare = {o / b:.3f}   (fp32 matmul peak {peak / 1e12:.3f} TFLOP/s)")


if __name__ == "__main__":
    main()
