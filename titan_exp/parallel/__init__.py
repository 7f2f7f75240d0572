"""Apply the configured parallelisms to one model part, in TorchTitan's order:
TP (+SP, loss parallel) -> async TP -> CP -> activation checkpointing -> compile -> FSDP/HSDP or DDP.
(Async TP, AC and compile are rejected by validation until they land.)"""

from __future__ import annotations

import torch
from torch import nn

from titan_exp.config import JobConfig
from titan_exp.parallel.context import apply_cp
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.fsdp import apply_ddp, apply_fsdp
from titan_exp.parallel.tensor import apply_tp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def loss_parallel_enabled(job: JobConfig, dims: ParallelDims) -> bool:
    return dims.tp > 1 and not job.parallelism.disable_loss_parallel


def parallelize(model: nn.Module, dims: ParallelDims, mesh, job: JobConfig) -> None:
    if dims.tp > 1:
        apply_tp(model, dims.submesh(mesh, "tp"), loss_parallel=loss_parallel_enabled(job, dims))
    if dims.cp > 1:
        apply_cp(model, dims.submesh(mesh, "cp"), job.training.seq_len)
    if dims.fsdp_enabled:
        shard = "dp_shard_cp" if dims.cp > 1 and dims.dp_shard > 1 else ("cp" if dims.dp_shard == 1 else "dp_shard")
        dp_mesh = mesh[("dp_replicate", shard)] if dims.dp_replicate > 1 else mesh[shard]
        apply_fsdp(
            model,
            dp_mesh,
            param_dtype=DTYPES[job.precision.param_dtype],
            reduce_dtype=DTYPES[job.precision.reduce_dtype],
            reshard_mode=job.parallelism.fsdp_reshard_after_forward,
            pp_enabled=dims.pp > 1,
        )
    elif dims.dp_replicate > 1:
        apply_ddp(model, dims.submesh(mesh, "dp_replicate"))
