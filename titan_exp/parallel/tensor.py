"""Tensor parallel with sequence parallel and loss parallel, TorchTitan's plan for Llama.

Between blocks activations are sharded along the sequence (Shard(1)); each block all-gathers
them before attention and the MLP (PrepareModuleInput), runs its projections column-wise then
row-wise, and reduce-scatters back to sequence shards. With loss parallel the output stays
sharded over the vocabulary and the cross entropy runs on the shards.

The embedding's reduce-scatter is synchronous (`SyncOutputRowwiseParallel`). torch's
RowwiseParallel redistributes asynchronously, so the embedding would hand the first block an
AsyncCollectiveTensor; when that block is compiled, the tensor crosses into the compiled region as
a graph input, and in backward AOTAutograd routes its gradient around `to_local`'s backward (which
gets None) straight into the redistribute's backward as a plain tensor, where a DTensor is
expected: `AttributeError: 'Tensor' object has no attribute '_local_tensor'` (torch 2.13, gloo or
NCCL; tests/test_compile_tp.py holds the torch-only repro, a strict xfail until torch handles it).
Waiting for the collective before the block starts changes no number and costs no overlap: the
block's first op needs its result anyway. (torch made the same choice for DTensor tangents at
compiled-graph boundaries, pytorch/pytorch#118671.)
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_exp.config import JobConfig, problem


class SyncOutputRowwiseParallel(RowwiseParallel):
    """RowwiseParallel whose output redistribute completes before the module returns, so the next
    module gets a plain tensor, not an AsyncCollectiveTensor (see the module doc). The local
    tensor is a copy, not `to_local`'s view of the DTensor's: FSDP, which wraps the embedding as a
    module of its own, warns on a view returned from it (torch 2.13, pytorch/pytorch#181850: an
    in-place op on the view would drop FSDP's pre-backward hook). The copy is one activation of
    seq_len / tp rows a microbatch."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts, async_op=False)
        return outputs.to_local().clone() if use_local_output else outputs


def check(job: JobConfig, dims, cuda: bool) -> list[str]:
    """The TP degree must divide every sharded size; async TP needs CUDA, compile and TP."""
    e: list[str] = []
    m = job.model
    if dims.tp > 1:
        for field, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads),
                             ("ffn hidden size (from model.dim/multiple_of/ffn_dim_multiplier)", m.ffn_hidden_dim),
                             ("the shared experts' width (model.moe_hidden_dim x n_shared_experts)",
                              m.expert_hidden_dim * m.n_shared_experts),
                             *([("the routed experts' width (model.moe_hidden_dim; without expert parallel "
                                 "TP splits every expert)", m.expert_hidden_dim)]
                               if m.is_moe and dims.ep == 1 else []),
                             ("the sequence per rank (training.seq_len / cp, sequence parallel)",
                              job.training.seq_len // dims.cp)):
            if value % dims.tp:
                e.append(problem("parallelism.tensor_parallel_degree", dims.tp,
                                 f"does not divide {field} = {value}; pick a degree that does"))
    if job.parallelism.enable_async_tensor_parallel:
        why = []
        if not cuda:
            why.append("needs CUDA (torch skips the fused collective-matmul passes without NCCL, "
                       "so it would do nothing)")
        if not job.compile.enable:
            why.append("needs compile.enable=true (it is a torch.compile pass)")
        if dims.tp == 1:
            why.append("needs tensor_parallel_degree > 1")
        if why:
            e.append(problem("parallelism.enable_async_tensor_parallel", True, "; ".join(why)))
    return e


def float8_collectives(job: JobConfig, cuda: bool) -> bool:
    """Whether TP's collectives run in float8: torchao's float8 TP styles do for tensorwise
    float8, on NCCL only (gloo has no float8 dtype; there only the matmuls are float8)."""
    p = job.precision
    return cuda and p.converter == "float8" and p.float8_recipe == "tensorwise"


def apply_tp(model: nn.Module, tp_mesh, *, loss_parallel: bool, float8: bool = False) -> None:
    """`float8`: the block linears are tensorwise float8; their styles then all-gather and
    reduce-scatter in float8 too (torchao's float8 variants of the same plan)."""
    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.output is not None:
        top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": prepare_input(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            **attention_plan(block.attention, colwise),
            "attention.wo": rowwise(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if hasattr(block.attention, "tp_mesh"):  # multi-head latent attention (attention_plan)
            block.attention.tp_mesh = tp_mesh
        if hasattr(block, "moe"):
            plan |= moe_plan(block.moe)
            distribute_moe_params(block.moe, tp_mesh)
        else:
            plan |= {
                "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
                "feed_forward.w3": colwise(),
            }
        parallelize_module(block, tp_mesh, plan)


def attention_plan(attention: nn.Module, colwise) -> dict[str, object]:
    """The projections into the heads, column-wise: Llama's wq, wk, wv (and its heads' QK-norm);
    under multi-head latent attention (titan_exp.models.mla) its up-projections, with the
    down-projections to the latents and their norms whole on every rank (ReplicateParallel)."""
    if not hasattr(attention, "wkv_a"):
        # QK-norm (Qwen3) normalizes each head: over a rank's heads (Shard(2) of (batch, seq, heads,
        # head_dim)), its weight replicated; DTensor sums the weight's gradient over the ranks' heads.
        per_head = SequenceParallel(sequence_dim=2, use_local_output=True)
        qk_norm = {f"attention.{n}": per_head for n in ("q_norm", "k_norm")} if attention.q_norm is not None else {}
        return {"attention.wq": colwise(), "attention.wk": colwise(), "attention.wv": colwise(), **qk_norm}
    queries = ["wq_a", "q_norm"] if hasattr(attention, "wq_a") else []
    whole = {f"attention.{name}": ReplicateParallel() for name in (*queries, "wkv_a", "kv_norm")}
    return whole | {f"attention.{name}": colwise() for name in ("wq_b" if queries else "wq", "wkv_b")}


class ReplicateParallel(ParallelStyle):
    """A module every TP rank runs whole on the same input (MLA's down-projections and their
    norms): its parameters become DTensors replicated over TP, as the optimizer's foreach ops need
    every parameter of a TP model to be; it takes plain tensors or replicated DTensors and returns
    plain tensors. The gradient flowing back into it is already the whole one on every rank (the
    column-wise up-projections sum theirs over the ranks' heads, and LatentAttention the shared
    RoPE key's), so nothing is reduced here."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                         for x in inputs)

        return distribute_module(module, device_mesh, input_fn=to_dtensor,
                                 output_fn=lambda mod, out, mesh: out.to_local())


def distribute_moe_params(moe: nn.Module, tp_mesh) -> None:
    """The router as a DTensor replicated over TP, and the routed experts, unless EP split them,
    sharded over TP along their hidden width (each expert's w1 and w3 by rows, w2 by columns:
    TorchTitan's expert tensor parallel, of degree tp); then every parameter of a TP model is a
    DTensor, which the optimizer's foreach ops need even where no FSDP makes them so.
    (MoE.forward computes with their local tensors, and learns from its `tp_mesh` which split
    it runs: see moe_plan.)"""
    from torch.distributed.tensor import DTensor, distribute_tensor

    moe.tp_mesh = tp_mesh

    hidden = {"w1": Shard(1), "w3": Shard(1), "w2": Shard(2)}  # (E, hidden, dim) and (E, dim, hidden)
    for module in (moe.router.gate, moe.experts):
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                placement = hidden[name] if module is moe.experts else Replicate()
                setattr(module, name, nn.Parameter(distribute_tensor(param, tp_mesh, [placement])))


def moe_plan(moe: nn.Module) -> dict[str, object]:
    """An MoE layer under TP: it takes the whole (gathered) sequence as a plain tensor, and every
    TP rank runs the router on all of it. Under expert parallel (`moe.ep_mesh` set: EP spreads over
    TP's ranks) each rank dispatches its own sequence shard's tokens to whole experts, so its
    output's rows of that shard are complete, and it hands back that shard (a local slice; its
    backward gathers); the shared experts' output is all-reduced. Without EP every rank runs every
    routed token through its slice of each expert's width (distribute_moe_params), as the shared
    experts run their column- and row-wise slices, so the layer's output is a partial sum,
    reduce-scattered to the sequence shards as a dense SwiGLU's is."""
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    out = Replicate() if moe.ep_mesh is not None else Partial()
    plan: dict[str, object] = {"moe": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(out,), desired_output_layouts=(Shard(1),), use_local_output=True)}
    if moe.shared_experts is not None:
        plan |= {"moe.shared_experts.w1": ColwiseParallel(), "moe.shared_experts.w3": ColwiseParallel(),
                 "moe.shared_experts.w2": RowwiseParallel(output_layouts=out)}
    return plan


def enable_async_tp(tp_mesh) -> None:
    """Let inductor fuse TP's all-gather/reduce-scatter with the adjacent matmuls (CUDA with
    symmetric memory and compile; validation rejects it anywhere else)."""
    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
