"""Data parallelism: FSDP2 (`fully_shard`), HSDP (a 2-D replicate x shard mesh) and DDP."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

RESHARD_MODES = ("default", "always", "never")


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
) -> None:
    """Shard each transformer block as one FSDP unit, the embedding and the norm+output as their
    own units, then the root (which owns whatever is left, e.g. RoPE tables)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=dp_mesh, mp_policy=mp)
    if model.tok_embeddings is not None:
        fully_shard(model.tok_embeddings, reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, False), **kwargs)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1 and model.output is None
        fully_shard(block, reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, last), **kwargs)
    if model.output is not None:
        fully_shard([model.norm, model.output], reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, True), **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward(reshard_mode, pp_enabled, True), **kwargs)


def apply_ddp(model: nn.Module, dp_mesh) -> None:
    """Replicate parameters and all-reduce gradients (torch's composable `replicate`)."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh)
