"""Activation checkpointing per transformer block: none, full, or selective.

- full: every block's activations are recomputed in backward.
- selective, option "op": per-op policy. Matmul outputs are saved except every second one, and
  attention outputs, reduce-scatters, expert parallel's all-to-alls and copies from a GPU to the
  host are always saved (recomputing them costs the most, or makes the host wait); the rest
  (norms, activations, elementwise, and the all-gathers of tensor and context parallel, whose
  outputs the recomputed linears and attention read) is recomputed. perf.model.comm prices the
  collectives each mode runs again; perf.model.memory.selective_saved counts what it keeps.
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
        # Every such run of the autotune benchmark on CPU over gloo (BENCHMARKS.md) failed
        # in backward: AOT autograd's saved-tensor check finds the DTensor's DeviceMesh among the
        # tensors. It is refused where it was seen; TorchTitan trains this combination on GPUs
        # (its Llama 3.1 70B and 405B tables).
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
    # EP's dispatch, combine and token counts (models.moe): recomputed, the tokens would cross the
    # EP group again. TorchTitan's policy saves them too.
    torch.ops._c10d_functional.all_to_all_single.default,
    _ops.max.default,  # float8 amax: cheap to save, a reduction to recompute
}
# torch 2.13's selective checkpoint replays a block's ops by their count in the forward, and fails
# where the recompute runs one more. FSDP's hooks on a unit nested in the block (an MoE layer's
# experts under EP, parallel/fsdp.py) open profiler ranges a different number of times in the
# recompute ("profiler._record_function_enter_new invocation index 3 ... not found in storage":
# pytorch/torchtitan#3427, pytorch/pytorch#185178). They make no model value, so the
# replay runs them without counting them (torch.utils.checkpoint.SAC_IGNORED_OPS, public).
PROFILER_OPS = [getattr(packet, overload) for packet in (torch.ops.profiler._record_function_enter,
                                                        torch.ops.profiler._record_function_enter_new,
                                                        torch.ops.profiler._record_function_exit)
                for overload in packet.overloads()]


def op_policy():
    """One block's per-op policy, with its own count of matmuls. Besides SAVE_ALWAYS and every
    other matmul it saves a copy from a GPU to the host (an MoE layer's token counts under EP,
    models.moe, which size its all-to-alls), as TorchTitan's policy does: recomputed, it would make
    the host wait for the GPU once more in each MoE layer's backward."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == _ops.mm.default:
            counts[mode] += 1
            # Save the 1st, 3rd, 5th... matmul of the block; recompute the others.
            return CheckpointPolicy.MUST_SAVE if counts[mode] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        if func == _ops._to_copy.default and args[0].is_cuda and _to_host(kwargs.get("device")):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_SAVE if func in SAVE_ALWAYS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _to_host(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _op_context():
    return create_selective_checkpoint_contexts(op_policy())


def apply_ac(model: nn.Module, mode: ACMode, option: str) -> None:
    if mode == ACMode.selective and option == "op":
        torch.utils.checkpoint.SAC_IGNORED_OPS.update(PROFILER_OPS)  # once, for every block's replay
    for name, block in list(model.layers.items()):
        if mode == ACMode.full:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif option == "op":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_context)
        elif int(name) % int(option) == 0:  # every Nth block, by its place in the whole model
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            continue
        model.layers[name] = wrapped
