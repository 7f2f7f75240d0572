"""Balanced pipeline stages on CPU: the split the planner picks (titan_exp.perf.search.stages)
against the splits around it, measured.

    python -m benchmarks.bench_stages [--steps 10] [--repeats 3] [--profile-dir DIR]

The model is the debug model with a 32k vocabulary and 16 blocks, whose output projection and loss
weigh about ten blocks: its last stage is heavy. It runs as PP 2 (1F1B) on 2 local gloo ranks,
seq 256, local batch 4 in microbatches of 1. The chooser prices the splits with this machine's
profile for that model at world 2 (python -m titan_exp.perf.calibrate, run first when the profile
lacks it, into --profile-dir). Measured beside its pick: the neighbouring splits (each end's
less_layers one up and one down, stepping on where that gives the same split, kept where the
validator accepts it) and the even split. Each split runs `--repeats` times, the runs interleaved
(split A, B, C, A, B, C, ...) because the machine is shared and noisy; a split's step is the
median over its runs of each run's median step after warm-up. Prints a markdown table: split,
blocks per stage, predicted step s, measured step s, vs the best measured.

The check, stated before it was run: the chosen split's measured step is within 3 % of the fastest
measured of the chosen split and its neighbours (the even split is shown, not part of the check).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import run_job
from titan_exp.config import compose_job
from titan_exp.parallel.pipeline import stage_split
from titan_exp.validation import resolve, validate

FIELDS = ("parallelism.pipeline_parallel_first_stage_less_layers",
          "parallelism.pipeline_parallel_last_stage_less_layers")
TOLERANCE = 0.03


def base(args: argparse.Namespace) -> list[str]:
    return ["model=debugmodel", f"model.vocab_size={args.vocab}", f"model.n_layers={args.layers}",
            f"training.seq_len={args.seq_len}",
            "parallelism.pipeline_parallel_degree=2", "parallelism.pipeline_parallel_schedule=1F1B",
            "parallelism.pipeline_parallel_microbatch_size=1", "training.local_batch_size=4",
            "training.global_batch_size=4", "cluster.nproc_per_node=2"]


def pair_overrides(pair: tuple[int, int]) -> list[str]:
    return [f"{field}={value}" for field, value in zip(FIELDS, pair)]


def blocks_of(job) -> tuple[int, ...]:
    return tuple(len(r) for r in stage_split(job.parallelism, job.model.n_layers))


def neighbours(overrides: list[str], chosen: tuple[int, int]) -> dict[tuple[int, ...], tuple[int, int]]:
    """The chosen pair's split and its neighbours': each end's field one up and one down, stepping
    on while that gives a split already listed, kept where the validator accepts it."""
    splits = {blocks_of(compose_job([*overrides, *pair_overrides(chosen)])): chosen}
    n = compose_job(overrides).model.n_layers
    for end in (0, 1):
        for direction in (-1, 1):
            pair = list(chosen)
            for _ in range(n):
                pair[end] += direction
                if pair[end] < 0:
                    break
                job = compose_job([*overrides, *pair_overrides(tuple(pair))])
                if validate(job, cuda=False):
                    break
                if blocks_of(job) not in splits:
                    splits[blocks_of(job)] = tuple(pair)
                    break
    return splits


def main(argv: list[str] | None = None) -> int:
    from titan_exp.perf import calibrate
    from titan_exp.perf.model.step import predict_step
    from titan_exp.perf.rates.profile import this_machine
    from titan_exp.perf.search import stages

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--profile-dir", default=None, help="where the CPU profile lives (default: <cache>/perf)")
    args = parser.parse_args(argv)
    overrides = base(args)
    folder = ["--profile-dir", args.profile_dir] if args.profile_dir else []
    shape = ["model=debugmodel", f"model.vocab_size={args.vocab}", f"training.seq_len={args.seq_len}"]
    if calibrate.main([*shape, "--world", "2", *folder]) != 0:  # reuses the profile where it has the model
        return 1
    profile = this_machine(2, folder=Path(args.profile_dir) if args.profile_dir else None)
    job = resolve(compose_job(overrides))
    chosen = stages.choose(job, profile, cuda=False)
    splits = neighbours(overrides, (chosen.first_less, chosen.last_less))
    even = blocks_of(job)
    shown_only = even not in splits  # the even split, shown but not one of the splits around the chosen one
    splits.setdefault(even, (0, 0))
    predicted = {b: predict_step(resolve(compose_job([*overrides, *pair_overrides(p)])), profile).step_s
                 for b, p in splits.items()}
    timing = [f"training.steps={args.steps}", f"metrics.warmup_steps={args.warmup}", f"metrics.log_freq={args.steps}"]
    measured: dict[tuple[int, ...], list[float]] = {b: [] for b in splits}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for i, (b, pair) in enumerate(splits.items()):
                code, summary = run_job([*overrides, *pair_overrides(pair), *timing], Path(tmp) / f"{r}-{i}")
                assert code == 0, summary and summary.get("error")
                measured[b].append(statistics.median(summary["step_times_s"][args.warmup:]))
    step = {b: statistics.median(times) for b, times in measured.items()}
    around = [b for b in splits if not (shown_only and b == even)]
    best = min(step[b] for b in around)
    print(f"debugmodel, vocab {args.vocab}, {args.layers} blocks, PP 2 (1F1B) on 2 gloo ranks, seq {args.seq_len}, "
          f"local batch 4 in microbatches of 1, {args.steps} steps ({args.warmup} warm-up), median of {args.repeats} "
          f"interleaved runs; predictions from {profile.name} ({profile.source})\n")
    print("| split (first, last less layers) | blocks per stage | predicted step s | measured step s | vs best |")
    print("|---|---|---|---|---|")
    for b, pair in splits.items():
        mark = " (chosen)" if b == chosen.blocks else " (even)" if b == even else ""
        print(f"| {pair[0]}, {pair[1]}{mark} | {'/'.join(map(str, b))} | {predicted[b]:.3f} | {step[b]:.3f} "
              f"| {step[b] / best - 1:+.1%} |")
    off = step[chosen.blocks] / best - 1
    print(f"\ncheck: the chosen split's measured step is {off:+.1%} from the fastest of it and its neighbours "
          f"(within {TOLERANCE:.0%}: {'PASS' if off <= TOLERANCE else 'FAIL'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
