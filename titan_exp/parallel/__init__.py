"""Apply the configured parallelisms and speed-ups to one model part, in TorchTitan's order:
EP -> TP (+SP, loss parallel) -> async TP -> CP -> activation checkpointing -> compile -> FSDP/HSDP or DDP.
(EP first: TP then replicates over its mesh only the MoE parameters EP left whole, the router's.)
(Low-precision converters run before this, on the whole meta model: see titan_exp.precision.)"""

from __future__ import annotations

import logging

from torch import nn

from titan_exp.config import ACMode, JobConfig
from titan_exp.parallel.activation_checkpoint import apply_ac
from titan_exp.parallel.compile import apply_compile
from titan_exp.parallel.context import apply_cp
from titan_exp.parallel.dims import ParallelDims
from titan_exp.parallel.expert import apply_ep
from titan_exp.parallel.fsdp import apply_ddp, apply_fsdp
from titan_exp.parallel.tensor import apply_tp, enable_async_tp, float8_collectives
from titan_exp.precision import DTYPES, compile_rounds_as_eager, fsdp_param_dtype

logger = logging.getLogger("titan_exp")


def loss_parallel_enabled(job: JobConfig) -> bool:
    return job.parallelism.tensor_parallel_degree > 1 and not job.parallelism.disable_loss_parallel


def compiles_loss(job: JobConfig) -> bool:
    """Whether the trainer compiles its loss: with the blocks, except under loss parallel (a
    DTensor loss stays eager)."""
    return job.compile.enable and not loss_parallel_enabled(job)


def parallelize(model: nn.Module, dims: ParallelDims, job: JobConfig) -> None:
    p = job.precision
    if dims.ep > 1:
        apply_ep(model, dims.mesh("ep"), dims.mesh("tp"))
    if dims.tp > 1:
        tp_mesh = dims.mesh("tp")
        float8 = float8_collectives(job, cuda=tp_mesh.device_type == "cuda")
        if float8_collectives(job, cuda=True) and not float8:  # the styles would, but not over gloo
            logger.info("float8: TP collectives in high precision (gloo has no float8 dtype); matmuls are float8")
        apply_tp(model, tp_mesh, loss_parallel=loss_parallel_enabled(job), float8=float8)
        model.tie_weights()  # each module's weight was distributed on its own (both Shard(0) on the vocab)
        if job.parallelism.enable_async_tensor_parallel:
            enable_async_tp(tp_mesh)
    if dims.cp > 1:
        apply_cp(model, dims.mesh("cp"), job.training.seq_len)
    if job.activation_checkpoint.mode != ACMode.none:
        apply_ac(model, job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option)
    if job.compile.enable:
        apply_compile(model, job.compile.backend.value, job.compile.fullgraph, compile_rounds_as_eager(p))
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.mesh("fsdp"),
            param_dtype=fsdp_param_dtype(p),
            reduce_dtype=DTYPES[p.reduce_dtype],
            reshard_mode=job.parallelism.fsdp_reshard_after_forward,
            pp_enabled=dims.pp > 1,
            experts_mesh=dims.mesh("efsdp") if dims.ep > 1 else None,
        )
    elif dims.dp_replicate > 1:
        apply_ddp(model, dims.mesh("replicate"))
