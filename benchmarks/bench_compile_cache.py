"""Cold and warm compile time of a 4-layout sweep, from an empty cache: what sharing inductor's
kernels across configs (parallel/compile.py) saves.

    python -m benchmarks.bench_compile_cache [--repo CHECKOUT] [--steps 3]

Runs each layout with compile.enable=true twice over, one after the other as a multirun would:
the first pass starts from an empty $TITAN_EXP_CACHE, the second finds what the first left. Each
member is `python launch.py` run from CHECKOUT (default: this one), so the same script measures
an older commit (`git worktree add /tmp/old <commit>` and --repo /tmp/old). Compile seconds are
the summary's `compile_s`: the first step's time beyond a typical step's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "single": [],
    "fsdp2": ["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"],
    "ddp2": ["parallelism=ddp", "training.local_batch_size=4"],
    "pp2": ["parallelism=pp"],
}
BASE = ["compile.enable=true", "training.seq_len=64", "training.global_batch_size=8", "metrics.log_freq=1"]


def run(repo: Path, overrides: list[str], run_dir: Path, cache: Path) -> dict:
    env = {**os.environ, "TITAN_EXP_CACHE": str(cache)}
    subprocess.run([sys.executable, "launch.py", f"hydra.run.dir={run_dir}", *overrides], cwd=repo, env=env,
                   capture_output=True, text=True, timeout=900)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.repo, capture_output=True,
                            text=True).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for sweep in ("cold", "warm"):
            for name, layout in LAYOUTS.items():
                summary = run(args.repo, [*BASE, f"training.steps={args.steps}", *layout], Path(tmp) / sweep / name,
                              cache)
                rows.append((sweep, name, summary))
    print(f"commit {commit}, {args.steps} steps per member\n")
    print("| sweep | layout | status | compile s | FX graph hits / misses |")
    print("|---|---|---|---|---|")
    totals: dict[str, float] = {}
    for sweep, name, s in rows:
        hits = f"{s['fx_graph_cache_hits']} / {s['fx_graph_cache_misses']}" if "fx_graph_cache_hits" in s else "n/a"
        print(f"| {sweep} | {name} | {s['status']} | {s.get('compile_s', float('nan')):.1f} | {hits} |")
        totals[sweep] = totals.get(sweep, 0.0) + s.get("compile_s", 0.0)
    print("\n" + ", ".join(f"{sweep} sweep: {total:.1f} s of compile" for sweep, total in totals.items()))


if __name__ == "__main__":
    main()
