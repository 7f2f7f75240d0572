"""The speed ladder's rungs on this machine: eager vs compile, fp32 vs bf16, AC modes.

    python -m benchmarks.bench_speed [--flavors debugmodel llama3_100m] [--steps 8]

One process (all cores) per configuration, a fresh one each time so that peak memory (RSS on
CPU) belongs to that configuration alone; compile runs once to warm its cache, then is
measured warm. Prints a markdown table per flavor: steady-state tokens/s, ratio to eager fp32,
peak memory, and the compile time of the cold and warm runs. (No MFU: bf16 and fp32 have
different peaks, and the ratio column already compares the runs.)
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import run_job

CONFIGS = {
    "eager fp32": [],
    "compile fp32": ["compile.enable=true"],
    "eager bf16": ["precision=bf16"],
    "compile bf16": ["compile.enable=true", "precision=bf16"],
    "AC selective (op)": ["activation_checkpoint.mode=selective"],
    "AC selective (every 2nd)": ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"],
    "AC full": ["activation_checkpoint.mode=full"],
}
SHAPES = {"debugmodel": (8, 256), "llama3_100m": (4, 256)}  # batch, seq_len


def run(flavor: str, extra: list[str], steps: int) -> dict:
    batch, seq = SHAPES[flavor]
    with tempfile.TemporaryDirectory() as run_dir:
        code, summary = run_job(
            [f"model={flavor}", f"training.local_batch_size={batch}", f"training.seq_len={seq}",
             f"training.steps={steps}", "metrics.warmup_steps=2", f"metrics.log_freq={steps}", *extra],
            Path(run_dir),
        )
    assert code == 0, summary
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavors", nargs="*", default=list(SHAPES))
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    for flavor in args.flavors:
        rows, base = [], None
        for name, extra in CONFIGS.items():
            cold = run(flavor, extra, 3) if "compile.enable=true" in extra else None
            s = run(flavor, extra, args.steps)
            base = base or s["tokens_per_second_per_device"]
            compile_note = f"{cold['compile_s']:.1f} / {s['compile_s']:.1f}" if cold else "-"
            rows.append(f"| {name} | {s['tokens_per_second_per_device']:.1f} | "
                        f"{s['tokens_per_second_per_device'] / base:.2f} | "
                        f"{s['peak_memory_gib']:.2f} | {compile_note} | {s['final_loss']:.4f} |")
            print(rows[-1], flush=True)
        batch, seq = SHAPES[flavor]
        print(f"\n{flavor}, batch {batch} x {seq}, {args.steps} steps (2 warm-up), 1 process\n")
        print("| config | tokens/s | vs eager fp32 | peak RSS GiB | compile s (cold / warm) | final loss |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows) + "\n", flush=True)


if __name__ == "__main__":
    main()
