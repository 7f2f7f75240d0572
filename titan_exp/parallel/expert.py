"""Expert parallel: each rank of the `ep` mesh holds n_experts / ep of every MoE layer's routed
experts (their weights are DTensors sharded on the expert dim), and tokens travel to them by
all-to-all (titan_exp.models.moe.MoE._exchange). The ep ranks are carved out of
dp_shard x cp x tp (titan_exp.parallel.dims), taking all of cp and tp, as TorchTitan does with
expert_tensor_parallel_degree 1 and Megatron-Core's MoE parallel folding with an expert TP of 1:
they still read different data (or, over tp, dispatch different tokens of the same sequences:
models.moe.MoE) and shard the dense parameters with FSDP; the experts are sharded by FSDP over
what is left (`efsdp`, parallel/fsdp.py)."""

from __future__ import annotations

from torch import nn

from titan_exp.config import JobConfig, problem


def check(job: JobConfig, dims, cuda: bool) -> list[str]:
    """EP divides the experts and fits inside dp_shard x cp x tp, taking all of cp and tp."""
    ep, m = dims.ep, job.model
    borrowed = dims.cp * dims.tp
    field = "parallelism.expert_parallel_degree"
    if ep == 1:
        return []
    if not m.is_moe:
        return [problem(field, ep, "needs an MoE model (model.n_experts > 0), e.g. model=moe_debug")]
    e = []
    if m.n_experts % ep:
        e.append(problem(field, ep, f"does not divide model.n_experts = {m.n_experts}; pick a degree that does"))
    if ep % borrowed:
        e.append(problem(field, ep, f"must be a multiple of context_parallel_degree x tensor_parallel_degree = "
                                    f"{dims.cp} x {dims.tp}: expert parallel borrows all of the context- and "
                                    "tensor-parallel ranks"))
    elif dims.dp_shard % (ep // borrowed):
        e.append(problem(field, ep, f"is carved out of data_parallel_shard_degree x context_parallel_degree x "
                                    f"tensor_parallel_degree = {dims.dp_shard} x {dims.cp} x {dims.tp}: "
                                    f"ep / (cp x tp) = {ep // borrowed} must divide data_parallel_shard_degree = "
                                    f"{dims.dp_shard}"))
    return e


def apply_ep(model: nn.Module, ep_mesh, tp_mesh=None) -> None:
    """Split every MoE layer's routed experts over `ep_mesh` (dim 0 of each expert weight) and
    let the layer dispatch over it; under TP (`tp_mesh`, inside ep_mesh) each TP rank dispatches
    the tokens of its own sequence shard (the layer gets its TP mesh where TP is applied:
    parallel.tensor.distribute_moe_params)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_exp.models.moe import MoE

    tp = tp_mesh.size() if tp_mesh is not None else 1
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        for name, param in list(moe.experts.named_parameters()):
            setattr(moe.experts, name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)])))
        moe.experts.grad_scale = tp / ep_mesh.size()  # see GroupedExperts
        moe.ep_mesh = ep_mesh
