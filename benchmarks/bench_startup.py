"""How long a local launch takes with its ranks forked from the forkserver against fresh processes.

    python -m benchmarks.bench_startup [--ranks 1 2 4] [--rounds 3] [titan_exp overrides]

Every launch runs in this one process, as the members of a sweep, autotune's trials or a test
session do: the debug model, 2 steps of SMALL (8 x 64 tokens, fp32) under FSDP over the ranks, with
`cluster.fork_ranks` true (forked from the server, titan_exp.cluster.forkserver) and false (each rank
a fresh `python -m titan_exp.train.rank` process), in turn, so the machine's drift falls on both.
The server's own start (its imports, once a process) is timed apart: it is the first launch's.
Prints the median wall seconds of a launch each way and their ratio, and rank 0's peak resident
memory each way (summary.json's peak_memory_gib), per rank count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_job

# The tests' smallest job that still trains: 8 x 64 tokens a step, fp32, deterministic.
SMALL = ["training.seq_len=64", "training.global_batch_size=8", "training.deterministic=true", "metrics.log_freq=1"]


def launch(ranks: int, fork: bool, extra: list[str]) -> tuple[float, float]:
    """(wall seconds, rank 0's peak RSS in GiB) of one launch."""
    layout = (["parallelism=fsdp", f"cluster.nproc_per_node={ranks}", f"training.local_batch_size={8 // ranks}"]
              if ranks > 1 else [])
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        code, summary = run_job([*SMALL, "training.steps=2", *layout, f"cluster.fork_ranks={str(fork).lower()}",
                                 *extra], Path(run_dir))
        seconds = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"the launch with {ranks} rank(s), fork_ranks={fork}, failed (exit {code})")
    return seconds, summary["peak_memory_gib"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    args, extra = parser.parse_known_args(argv)
    first, _ = launch(args.ranks[0], True, extra)
    print(f"first launch, {args.ranks[0]} rank(s), forked (the server's imports included): {first:.1f} s")
    print("| ranks | fresh processes, s a launch | forked, s a launch | fresh / forked "
          "| rank 0's peak RSS GiB, fresh | forked |")
    print("|---|---|---|---|---|---|")
    for ranks in args.ranks:
        runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for fork in (False, True):
                runs[fork].append(launch(ranks, fork, extra))
        (fresh, fresh_rss), (forked, forked_rss) = (
            (statistics.median(t for t, _ in runs[f]), statistics.median(m for _, m in runs[f])) for f in (False, True))
        print(f"| {ranks} | {fresh:.1f} | {forked:.1f} | {fresh / forked:.2f} | {fresh_rss:.2f} | {forked_rss:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
