"""The planner against TorchTitan's published Llama 3.1 runs on H100.

    python -m benchmarks.published.torchtitan

The rows are TorchTitan's benchmarks/llama3_h100_202412_torchtitan.md (Tables 1-6: 8B on 8 and 128
GPUs, 8B with context parallel to 262k tokens, 70B 2D on 256 GPUs, 405B 3D and 4D on 512), each
with the configuration that run used (local batch, sequence length, AC, compile, float8, schedule).
The device is the `h100_500w` spec (titan_exp/perf/rates/devices.py: the 96 GB, 500 W H100 those runs
used). Tokens/s are the GPU model's from its parts (titan_exp/perf/model/block.py; its one fitted term,
compute_scale, comes from the validation's fitting set (fit.py), where the leave-one-source-
out scores are; the rows in that set, Table 1 and Table 4, whose async TP the model was changed
for, are marked and their tokens/s not scored here). Memory is the model's from its parts
(titan_exp/perf/model/memory.py and memory_gpu.py: the counted tensors, the loss as an H200 counted
it, the caching allocator's rounding, cuBLAS's workspaces, float8's copies; TorchTitan reports the
allocator's reserved peak, so NCCL's buffers, outside it, are not in the total). Nothing in it is
fitted on these rows: every row's memory (18) is predicted and set beside the published one.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass, field

from titan_exp.config import Executor, compose_job
from titan_exp.perf.model.memory import GpuMemory, predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.devices import SPECS, Efficiency, spec_profile
from titan_exp.validation import resolve, validate

from .engines import ENGINES
from .fit import fitting_set
from .predict import plan_rows
from .rows import read_rows

DEVICE = "h100_500w"


@dataclass
class Row:
    table: int
    label: str
    model: str
    world: int
    degrees: dict[str, int]
    local_batch: int
    seq_len: int
    ac: str  # selective | full
    compile: bool
    float8: bool
    tps: float  # published tokens/s/GPU
    memory_gib: float  # published peak memory
    schedule: str | None = None
    async_tp: bool = False
    extra: list[str] = field(default_factory=list)


def rows() -> list[Row]:
    r = []
    for label, compile_, f8, tps, mem in (("FSDP", False, False, 5762, 82.4),
                                          ("FSDP + compile", True, False, 6667, 77.0),
                                          ("FSDP + compile + float8", True, True, 8532, 76.8)):
        r.append(Row(1, label, "llama3_8b", 8, {"dp_shard": 8}, 2, 8192, "selective", compile_, f8, tps, mem))
    for dps, cp, seq, tps, mem in ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0),
                                   (1, 8, 262144, 548, 84.5)):
        r.append(Row(2, f"FSDP {dps}, CP {cp}, seq {seq}", "llama3_8b", 8, {"dp_shard": dps, "cp": cp}, 1, seq, "full",
                     True, True, tps, mem))
    for label, compile_, f8, tps, mem in (("FSDP", False, False, 5605, 67.0),
                                          ("FSDP + compile", True, False, 6514, 62.0),
                                          ("FSDP + compile + float8", True, True, 8380, 61.8)):
        r.append(Row(3, label + " (128 GPUs)", "llama3_8b", 128, {"dp_shard": 128}, 2, 8192, "selective", compile_, f8,
                     tps, mem))
    for label, async_tp, tps, mem in (("2D", False, 829, 71.9), ("2D + async TP", True, 876, 67.6)):
        r.append(Row(4, label, "llama3_70b", 256, {"dp_shard": 32, "tp": 8}, 16, 8192, "full", True, True, tps, mem,
                     async_tp=async_tp))
    for schedule, tps, mem in (("1F1B", 100, 82.5), ("Interleaved1F1B", 128, 72.7)):
        r.append(Row(5, schedule, "llama3_405b", 512, {"dp_shard": 8, "tp": 8, "pp": 8}, 32, 8192, "full", True, True,
                     tps, mem, schedule=schedule, async_tp=True))
    for dps, cp, seq, tps, mem in ((8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9), (2, 4, 131072, 31, 77.1),
                                   (1, 8, 262144, 16, 84.9)):
        r.append(Row(6, f"FSDP {dps}, CP {cp}, seq {seq}", "llama3_405b", 512,
                     {"dp_shard": dps, "cp": cp, "tp": 8, "pp": 8}, 8, seq, "full", True, True, tps, mem,
                     schedule="1F1B", async_tp=True))
    return r


FIELDS = {"dp_shard": "data_parallel_shard_degree", "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree",
          "cp": "context_parallel_degree"}


_JOBS: dict[tuple[int, str], object] = {}


def job_for(row: Row):
    """The row's job, composed once (the fits below predict each row many times)."""
    key = (row.table, row.label)
    if key not in _JOBS:
        _JOBS[key] = _compose(row)
    return _JOBS[key]


def _compose(row: Row):
    overrides = [f"model={row.model}", f"training.local_batch_size={row.local_batch}",
                 f"training.seq_len={row.seq_len}",
                 f"training.global_batch_size={row.local_batch * row.degrees['dp_shard']}",
                 "precision=float8" if row.float8 else "precision=bf16", f"activation_checkpoint.mode={row.ac}",
                 f"compile.enable={str(row.compile).lower()}", f"model.max_seq_len={max(row.seq_len, 8192)}",
                 f"parallelism.enable_async_tensor_parallel={str(row.async_tp).lower()}",
                 *[f"parallelism.{FIELDS[d]}={v}" for d, v in row.degrees.items()]]
    if row.schedule:
        # TorchTitan (Dec 2024) split the local batch into as many microbatches as pipeline ranks.
        overrides += [f"parallelism.pipeline_parallel_schedule={row.schedule}",
                      f"parallelism.pipeline_parallel_microbatch_size={row.local_batch // row.degrees['pp']}"]
    job = compose_job([*overrides, *row.extra])
    per_node = min(8, row.world)
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, executor=Executor.slurm,
                                                               nnodes=row.world // per_node, nproc_per_node=per_node,
                                                               gpus_per_node=per_node))
    errors = validate(job, cuda=True)
    if errors:
        raise SystemExit(f"table {row.table} {row.label}: {errors}")
    return resolve(job)


def predict_tps(row: Row, eff: Efficiency) -> float:
    spec = SPECS[DEVICE]
    profile = spec_profile(spec, row.world, min(8, row.world), eff, ENGINES["torchtitan"].kernel(spec.architecture))
    return predict_step(job_for(row), profile, cuda=True, engine=ENGINES["torchtitan"].engine).tokens_per_s_per_device


def predict_memory_gib(row: Row, gpu: GpuMemory) -> float:
    return predict_memory(job_for(row), cuda=True, gpu=gpu, engine=ENGINES["torchtitan"].engine)["total"]


def tokens_fitted_tables() -> set[int]:
    """The tables whose tokens/s the validation fits compute_scale on: Table 1, declared, and
    those the model was later changed for (its MOVED_TO_FIT)."""
    planned = plan_rows([r for r in read_rows() if r.source == "torchtitan"])
    return {int(p.row.table.split()[1]) for p in fitting_set(planned)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.published.torchtitan",
                                     description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    all_rows = rows()
    tps_fitting = tokens_fitted_tables()
    eff, gpu = Efficiency(), GpuMemory(architecture=SPECS[DEVICE].architecture)
    print("| table | run | published tok/s/GPU | predicted | error | published GiB | predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    tps_err, mem_err, orders = [], [], {}
    for row in all_rows:
        tps = predict_tps(row, eff)
        mem = predict_memory_gib(row, gpu)
        e_t, e_m = 100 * (tps / row.tps - 1), 100 * (mem / row.memory_gib - 1)
        fit_tps = row.table in tps_fitting
        if not fit_tps:
            tps_err.append(abs(e_t))
            orders.setdefault(row.table, []).append((row.tps, tps))
        mem_err.append(abs(e_m))
        print(f"| {row.table}{' (fit: tokens/s)' if fit_tps else ''} | {row.label} | {row.tps:,.0f} | "
              f"{tps:,.0f} | {e_t:+.0f} % | {row.memory_gib:.1f} | {mem:.1f} | {e_m:+.0f} % |")
    kept = [t for t, pairs in orders.items()
            if sorted(range(len(pairs)), key=lambda i: pairs[i][0])
            == sorted(range(len(pairs)), key=lambda i: pairs[i][1])]
    print()
    print(f"held-out rows: {len(tps_err)} for tokens/s, {len(mem_err)} for memory (none fitted); tokens/s |error| "
          f"median {statistics.median(tps_err):.0f} %, worst {max(tps_err):.0f} %, "
          f"within 25 %: {sum(e <= 25 for e in tps_err)}; memory |error| median "
          f"{statistics.median(mem_err):.0f} %, worst {max(mem_err):.1f} %, "
          f"within 10 %: {sum(e <= 10 for e in mem_err)}; "
          f"published ordering kept in tables {sorted(kept)} of {sorted(orders)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
