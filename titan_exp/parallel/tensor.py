"""Tensor parallel with sequence parallel and loss parallel, TorchTitan's plan for Llama.

Between blocks activations are sharded along the sequence (Shard(1)); each block all-gathers
them before attention and the MLP (PrepareModuleInput), runs its projections column-wise then
row-wise, and reduce-scatters back to sequence shards. With loss parallel the output stays
sharded over the vocabulary and the cross entropy runs on the shards.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(model: nn.Module, tp_mesh, *, loss_parallel: bool) -> None:
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
