"""One rank of 64- to 512-GPU layouts of the Llama 3.1 8B and 70B shapes (or, --cases qwen3, of
Qwen3 32B and 235B-A22B), built and stepped alone on this machine (cluster.dry_run), against the
planner's memory model (issue 19).

    python -m benchmarks.bench_dry_run [--seq-len 256] [--cases qwen3 | held_out] [--only NAME]

The full models do not fit this machine's memory or time (one step of two 8B blocks and the
output layer at 2048 tokens took over 4 minutes on 2 cores), so each case keeps the model's
width, vocabulary and layout but builds fewer layers (`layers`) and a short sequence; the rank
then holds its shards of those. Parameters, gradients and
AdamW state grow linearly with the layers, and so does what the planner predicts for them, so a
case checks the per-layer and per-model terms at the real width and world size; the last column
is the planner's prediction for the full depth, which the dry run has not measured. Peak memory
is measured two ways during the step. The tensor peak is the peak bytes of live tensor storage
(what torch's allocator reports on a GPU), set beside the planner's peak less its fixed runtime.
The resident peak is the process's high-water mark, reset after the model is built, set beside
the planner's whole CPU peak. The build's own resident peak (initialisation) is its own column.
On a GPU the dry run reads torch's allocator instead.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.common import run_job
from titan_exp.config import compose_job

CASES = [  # (name, model, layers built, full depth, world as nodes x 8, layout overrides, rank)
    ("8B FSDP 64", "llama3_8b", 2, 32, 8, ["parallelism.data_parallel_shard_degree=64"], 0),
    ("8B HSDP 8x8", "llama3_8b", 2, 32, 8, ["parallelism.data_parallel_replicate_degree=8",
                                            "parallelism.data_parallel_shard_degree=8"], 0),
    ("8B FSDP 16 x TP 4", "llama3_8b", 2, 32, 8, ["parallelism.data_parallel_shard_degree=16",
                                                  "parallelism.tensor_parallel_degree=4"], 0),
    ("8B PP 4 x FSDP 16 (last stage)", "llama3_8b", 4, 32, 8, ["parallelism.pipeline_parallel_degree=4",
                                                               "parallelism.data_parallel_shard_degree=16"], 63),
    ("70B FSDP 64 x TP 8", "llama3_70b", 1, 80, 64, ["parallelism.data_parallel_shard_degree=64",
                                                     "parallelism.tensor_parallel_degree=8"], 0),
    ("70B PP 8 x FSDP 8 x TP 8 (first stage)", "llama3_70b", 8, 80, 64, [
        "parallelism.pipeline_parallel_degree=8", "parallelism.data_parallel_shard_degree=8",
        "parallelism.tensor_parallel_degree=8"], 0),
]
# Qwen3 (--cases qwen3): the 32B at 64 ranks, the 235B-A22B MoE at 256 and 512 with expert parallel
# (its 4 KV heads allow TP up to 4).
QWEN3_CASES = [
    ("Qwen3 32B FSDP 64", "qwen3_32b", 1, 64, 8, ["parallelism.data_parallel_shard_degree=64"], 0),
    ("Qwen3 32B FSDP 16 x TP 4", "qwen3_32b", 2, 64, 8, ["parallelism.data_parallel_shard_degree=16",
                                                         "parallelism.tensor_parallel_degree=4"], 0),
    ("Qwen3 235B-A22B FSDP 256 x EP 8", "qwen3_235b_a22b", 1, 94, 32, [
        "parallelism.data_parallel_shard_degree=256", "parallelism.expert_parallel_degree=8"], 0),
    ("Qwen3 235B-A22B FSDP 128 x TP 4 x EP 64", "qwen3_235b_a22b", 1, 94, 64, [
        "parallelism.data_parallel_shard_degree=128", "parallelism.tensor_parallel_degree=4",
        "parallelism.expert_parallel_degree=64"], 0),
]

# Held out (--cases held_out): these shapes were named here before any of them was dry-run, and are not
# changed after: the memory model is checked on them, not fitted. The criterion: each case's tensor peak
# as predicted within 10 % of the one measured. They cover what the cases above do not: each AC mode
# (full, per-op selective), pipeline schedules (1F1B with AC, Interleaved1F1B with two stages a rank),
# a 512-rank 3D layout, MoE under EP (64 and 512 ranks), and bf16 parameters.
HELD_OUT_CASES = [
    ("8B FSDP 64, AC full", "llama3_8b", 2, 32, 8, ["parallelism.data_parallel_shard_degree=64",
                                                    "activation_checkpoint.mode=full"], 0),
    ("8B FSDP 64, AC selective per op", "llama3_8b", 2, 32, 8, [
        "parallelism.data_parallel_shard_degree=64", "activation_checkpoint.mode=selective",
        "activation_checkpoint.selective_ac_option=op"], 0),
    ("8B FSDP 64, bf16", "llama3_8b", 2, 32, 8, ["parallelism.data_parallel_shard_degree=64", "precision=bf16"], 0),
    ("8B PP 8 x FSDP 8, 1F1B, AC full (first stage)", "llama3_8b", 8, 32, 8, [
        "parallelism.pipeline_parallel_degree=8", "parallelism.data_parallel_shard_degree=8",
        "parallelism.pipeline_parallel_schedule=1F1B", "activation_checkpoint.mode=full"], 0),
    ("8B PP 4 x FSDP 16, Interleaved1F1B, 2 stages a rank (last stage)", "llama3_8b", 8, 32, 8, [
        "parallelism.pipeline_parallel_degree=4", "parallelism.data_parallel_shard_degree=16",
        "parallelism.pipeline_parallel_schedule=Interleaved1F1B", "parallelism.pipeline_parallel_stages_per_rank=2"],
     63),
    ("70B PP 4 x FSDP 16 x TP 8, AC selective per op (last stage)", "llama3_70b", 4, 80, 64, [
        "parallelism.pipeline_parallel_degree=4", "parallelism.data_parallel_shard_degree=16",
        "parallelism.tensor_parallel_degree=8", "activation_checkpoint.mode=selective",
        "activation_checkpoint.selective_ac_option=op"], 511),
    ("Qwen3 30B-A3B FSDP 64 x EP 8", "qwen3_30b_a3b", 1, 48, 8, ["parallelism.data_parallel_shard_degree=64",
                                                                 "parallelism.expert_parallel_degree=8"], 0),
    ("Qwen3 30B-A3B FSDP 128 x TP 4 x EP 32, AC full", "qwen3_30b_a3b", 1, 48, 64, [
        "parallelism.data_parallel_shard_degree=128", "parallelism.tensor_parallel_degree=4",
        "parallelism.expert_parallel_degree=32", "activation_checkpoint.mode=full"], 0),
]
CASE_SETS = {"llama": CASES, "qwen3": QWEN3_CASES, "held_out": HELD_OUT_CASES}


def overrides_for(model: str, layers: int, nodes: int, layout: list[str], rank: int, seq: int) -> list[str]:
    """The dry run's overrides: fp32, no AC, a microbatch a pipeline stage, unless `layout` sets them."""
    pp = next((int(o.split("=")[1]) for o in layout if "pipeline_parallel_degree" in o), 1)
    defaults = [o for o in ("precision=fp32", "activation_checkpoint.mode=none")
                if not any(s.split("=")[0] == o.split("=")[0] for s in layout)]
    return [f"model={model}", *defaults, f"model.n_layers={layers}",
            f"training.seq_len={seq}", "training.local_batch_size=" +
            str(pp), "training.global_batch_size=-1", "parallelism.pipeline_parallel_microbatch_size=1",
            f"cluster.nnodes={nodes}", "cluster.nproc_per_node=8", *layout, "cluster.dry_run=true",
            f"cluster.dry_run_rank={rank}"]


def main(argv: list[str] | None = None) -> int:
    from titan_exp.perf.model.memory import predict_memory, tensor_gib
    from titan_exp.validation import resolve

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--cases", choices=tuple(CASE_SETS), default="llama")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    print("| case | world | layers built | states GiB measured / predicted | tensor peak GiB measured / predicted | "
          "error | resident peak GiB measured / predicted | error | build peak GiB | full depth: planner's peak GiB "
          "| wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [c for c in CASE_SETS[args.cases] if args.only is None or args.only in c[0]]
    for name, model, layers, depth, nodes, layout, rank in cases:
        overrides = overrides_for(model, layers, nodes, layout, rank, args.seq_len)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            code, summary = run_job(overrides, Path(tmp))
        if code != 0:
            print(f"| {name} | failed: {(summary or {}).get('error', '')[:200]} |")
            continue
        report = summary["dry_run"]
        m, p = report["measured"], report["predicted"]
        full = resolve(compose_job([o for o in overrides if not o.startswith("model.n_layers")]))
        pp_rank = rank // (full.world_size // full.parallelism.pipeline_parallel_degree)
        at_depth = predict_memory(full, pp_rank=pp_rank)["total"]
        tensors = tensor_gib(p)
        error = 100 * (p["total"] / m["peak_gib"] - 1)
        tensor_error = 100 * (tensors / m["tensor_peak_gib"] - 1)
        rows.append({"case": name, "world": report["world"], "layers": layers, **m, "predicted": p,
                     "tensor_error_pct": tensor_error,
                     "full_depth_gib": at_depth, "wall_s": time.perf_counter() - start})
        print(f"| {name} (rank {rank}) | {report['world']} | {layers} of {depth} | {m['states_gib']:.3f} / "
              f"{p['states']:.3f} | {m['tensor_peak_gib']:.2f} / {tensors:.2f} | {tensor_error:+.0f} % | "
              f"{m['peak_gib']:.2f} / {p['total']:.2f} | {error:+.0f} % | {m['build_peak_gib']:.2f} | "
              f"{at_depth:.1f} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)
    within = sum(abs(r["tensor_error_pct"]) <= 10 for r in rows)
    print(f"\ntensor peak within 10 %: {within} of {len(rows)} measured ({len(cases)} cases)")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
