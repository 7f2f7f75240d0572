"""Activation checkpointing per transformer block: none, full, or selective.

- full: every block's activations are recomputed in backward.
- selective, option "op": per-op policy. Matmul outputs are saved except every second one, and
  attention outputs and reduce-scatters are always saved (recomputing them costs the most); the
  rest (norms, activations, elementwise) is recomputed.
- selective, option N: every Nth block is fully checkpointed, the others keep everything.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_exp.config import ACMode, JobConfig, problem


def check(job: JobConfig, cuda: bool) -> list[str]:
    ac = job.activation_checkpoint
    option = ac.selective_ac_option
    if ac.mode == ACMode.selective and option != "op" and not (option.isdigit() and int(option) >= 1):
        return [problem("activation_checkpoint.selective_ac_option", option,
                        "'op' for the per-op policy or a positive integer N to checkpoint every Nth block")]
    if ac.mode == ACMode.full and job.compile.enable and job.parallelism.tensor_parallel_degree > 1 and not cuda:
        # Every such run of the autotune benchmark on CPU over gloo (BENCHMARKS.md, issue 13) failed
        # in backward: AOT autograd's saved-tensor check finds the DTensor's DeviceMesh among the
        # tensors. It is refused where it was seen; TorchTitan trains this combination on GPUs
        # (its Llama 3.1 70B and 405B tables, issue 36).
        return [problem("activation_checkpoint.mode", "full", "fails on CPU with compile.enable=true and tensor "
                        "parallel in torch 2.13 (AOT autograd saves a DeviceMesh for the recompute): use "
                        "activation_checkpoint.mode=selective, or compile.enable=false")]
    return []

_ops = torch.ops.aten
# Attention kernels differ by device: the CPU one is its own op, not the CUDA names.
SAVE_ALWAYS = {
    _ops._scaled_dot_product_flash_attention_for_cpu.default,
    _ops._scaled_dot_product_flash_attention.default,
    _ops._scaled_dot_product_efficient_attention.default,
    _ops._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    _ops.max.default,  # float8 amax: cheap to save, a reduction to recompute
}


def _op_policy():
    def selective_context():
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == _ops.mm.default:
                counts[mode] += 1
                # Save the 1st, 3rd, 5th... matmul of the block; recompute the others.
                return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in SAVE_ALWAYS else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return selective_context


def apply_ac(model: nn.Module, mode: ACMode, option: str) -> None:
    for name, block in list(model.layers.items()):
        if mode == ACMode.full:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif option == "op":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_policy())
        elif int(name) % int(option) == 0:  # every Nth block, by its place in the whole model
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        model.layers[name] = wrapped
