"""Data parallelism: FSDP2 (`fully_shard`), HSDP (a 2-D replicate x shard mesh) and DDP."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan_exp.config import JobConfig, problem

RESHARD_MODES = ("default", "always", "never")


def check(job: JobConfig, dims, cuda: bool) -> list[str]:
    """The reshard mode, and which data-parallel flavours compose with TP/PP."""
    e: list[str] = []
    mode = job.parallelism.fsdp_reshard_after_forward
    if mode.isdigit():
        group = dims.dp_shard * dims.cp
        if not (1 < int(mode) < group and group % int(mode) == 0):
            e.append(problem("parallelism.fsdp_reshard_after_forward", mode,
                             f"an integer must be a proper divisor (> 1) of the FSDP group size {group}; "
                             f"or choose one of {', '.join(RESHARD_MODES)}"))
    elif mode not in RESHARD_MODES:
        e.append(problem("parallelism.fsdp_reshard_after_forward", mode,
                         f"choose one of {', '.join(RESHARD_MODES)} or an integer group size"))
    if dims.dp_replicate > 1 and not dims.fsdp_enabled and (dims.tp > 1 or dims.pp > 1):
        e.append(problem("parallelism.data_parallel_replicate_degree", dims.dp_replicate,
                         "replicate-only data parallel (DDP) does not compose with TP/PP; "
                         "shard too (data_parallel_shard_degree > 1, i.e. HSDP) or use FSDP"))
    return e


def reshard_after_forward(mode: str, pp_enabled: bool, last_block: bool) -> bool | int:
    """'default' frees gathered parameters after forward except where that only costs: under PP
    (every microbatch would gather again) and for the last block (its backward comes next).
    An integer N keeps parameters sharded over groups of N ranks between forward and backward
    (less memory than 'never', a cheaper all-gather than 'always'; usually the ranks of a node)."""
    if mode.isdigit():
        return int(mode)
    if mode == "always":
        return True
    if mode == "never":
        return False
    return not pp_enabled and not last_block


def apply_fsdp(
    model: nn.Module,
    dp_mesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_mode: str,
    pp_enabled: bool,
    experts_mesh=None,
) -> None:
    """Shard each transformer block as one FSDP unit, the embedding and the norm+output as their
    own units (tied embeddings: the three in one), then the root (which owns whatever is left, e.g.
    RoPE tables).

    Under expert parallel (`experts_mesh`, the efsdp mesh) an MoE block's routed experts are a
    unit of their own, sharded over efsdp only (the ep ranks already split them). FSDP averages
    their gradients over efsdp; the experts themselves divide by ep (models.moe.GroupedExperts:
    gloo has no pre-multiplied sum for FSDP's own divide factor). Without it they stay in their
    block's unit. Either way experts_placement says along which dim FSDP shards them."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=dp_mesh, mp_policy=mp)
    # Tied embeddings are one Parameter, which FSDP shards once: in one unit with the output.
    tied = model.tok_embeddings is not None and model.output is not None and model.cfg.tie_word_embeddings
    if model.tok_embeddings is not None and not tied:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, False),
                    **kwargs)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1 and model.output is None
        if experts_mesh is not None and hasattr(block, "moe"):
            fully_shard(block.moe.experts, mesh=experts_mesh, mp_policy=mp,
                        reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, last),
                        shard_placement_fn=experts_placement(block.moe.experts, experts_mesh))
        in_block = experts_mesh is None and hasattr(block, "moe")  # the routed experts, in the block's unit
        placement = experts_placement(block.moe.experts, dp_mesh) if in_block else None
        fully_shard(block, reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, last),
                    shard_placement_fn=placement, **kwargs)
    if model.output is not None:
        fully_shard([model.tok_embeddings, model.norm, model.output] if tied else [model.norm, model.output],
                    reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, True), **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, True), **kwargs)


def experts_placement(experts: nn.Module, mesh):
    """FSDP shards dim 0 by default; a rank's experts (dim 0) are often fewer than the ranks
    sharding them (8 experts, EP 8, efsdp 8: one each; or, without EP, 8 experts over FSDP 32),
    which would pad most ranks' shares to a whole expert's. Then the experts are sharded along
    their rows (dim 1), as TorchTitan does; the block's other parameters keep dim 0."""
    from torch.distributed.tensor import DTensor, Shard

    local = experts.w1.to_local() if isinstance(experts.w1, DTensor) else experts.w1
    if local.shape[0] % mesh.size(mesh.ndim - 1) == 0:
        return None
    ids = {id(p) for p in experts.parameters()}
    return lambda param: Shard(1) if id(param) in ids else None


def apply_ddp(model: nn.Module, dp_mesh) -> None:
    """Replicate parameters and all-reduce gradients (torch's composable `replicate`)."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh)
