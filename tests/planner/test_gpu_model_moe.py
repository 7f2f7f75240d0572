"""The GPU model's MoE layer (issue 36): expert parallel over TP, its TP collectives, the grouped
GEMM, its host ops and dispatch bytes as this toolkit's layer runs them. Arithmetic only."""

from __future__ import annotations

import dataclasses

import pytest
from gpu_model_jobs import H100, K100, olmoe_job

from titan_exp.config import compose_job
from titan_exp.perf.model import block as gpu
from titan_exp.perf.model.comm import moe_tp_extra
from titan_exp.perf.model.engine import Engine
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates import model_ops
from titan_exp.perf.rates.devices import spec_profile
from titan_exp.perf.rates.kernels import hbm
from titan_exp.perf.rates.profile import Line
from titan_exp.validation import resolve

pytestmark = pytest.mark.quick


def test_expert_parallel_over_tp_ranks_dispatches_a_sequence_shard_on_each():
    """EP spreads over TP's ranks (parallel.expert): a TP 2 rank of EP 8 dispatches its half of
    the sequence, so its routed experts cost what a TP 1 rank's cost on half the tokens and its
    all-to-alls carry half the bytes; without EP every TP rank runs all the tokens through half of
    every expert's width (parallel.tensor), what experts half as wide cost at TP 1."""
    def job(tp: int, ep: int, seq: int, *more: str):
        return olmoe_job(ep, f"parallelism.tensor_parallel_degree={tp}", f"training.seq_len={seq}",
                         f"parallelism.data_parallel_shard_degree={8 // tp}", f"training.global_batch_size={8 // tp}",
                         *more)

    def routed(j, tokens):
        return gpu.routed_experts(j, tokens, K100, "bfloat16", "bfloat16", None, "compiled", model_ops.LLAMA)

    experts = ("up", "down", "bwd")  # the router and the per-token copies see every token on every TP rank
    tp2, tp1 = routed(job(2, 8, 1024), 1024), routed(job(1, 8, 1024), 512)
    assert [getattr(tp2, f) for f in experts] == pytest.approx([getattr(tp1, f) for f in experts])
    half_width = routed(job(1, 1, 1024, "model.moe_hidden_dim=512"), 1024)  # OLMoE's experts are 1024 wide
    assert [getattr(routed(job(2, 1, 1024), 1024), f) for f in experts] == pytest.approx(
        [getattr(half_width, f) for f in experts])
    profile = spec_profile(H100, 8, 8)
    a2a_tp2, a2a_tp1 = (predict_step(j, profile, cuda=True).parts["ep"] for j in (job(2, 8, 1024), job(1, 8, 512)))
    assert a2a_tp2 == pytest.approx(a2a_tp1)
    assert a2a_tp2 < predict_step(job(1, 8, 1024), profile, cuda=True).parts["ep"]  # TP 1, the whole sequence


def test_an_moe_layers_tp_collectives_are_those_its_plan_runs():
    """parallel.tensor.moe_plan's collectives beside a dense SwiGLU's (an all-gather and a
    reduce-scatter each way), at ring costs (an all-reduce moves twice a reduce-scatter's bytes):
    without EP the routed tokens' input gradient is all-reduced, and the shared experts' twice
    (w1's and w3's), where a SwiGLU reduce-scatters one; under EP over TP nothing is
    reduce-scattered, forward or backward, only the shared experts' output all-reduced, and their
    input gradient twice. Both all-reduce the combine weights' gradient, tokens x top_k in fp32.
    OLMoE: every layer MoE, top 8, no shared experts. (tests/test_moe.py counts them on the layer.)"""
    rs, ar = Line(0.0, 1e-9), Line(0.0, 2e-9)
    act_elements = 1024 * 2048  # tokens x dim
    act, weights = act_elements * 2, ar(1024 * 8 * 4)

    def extra(ep, *more):
        return moe_tp_extra(olmoe_job(ep, "parallelism.tensor_parallel_degree=2", *more), rs, ar, act_elements, act)
    assert extra(1) == pytest.approx(rs(act) + weights)  # all-reduced where reduce-scattered
    assert extra(1, "model.n_shared_experts=1") == pytest.approx(5 * rs(act) + weights)
    assert extra(8) == pytest.approx(-2 * rs(act) + weights)
    assert extra(8, "model.n_shared_experts=1") == pytest.approx(4 * rs(act) + weights)
    assert moe_tp_extra(resolve(compose_job(["model=llama3_8b"])), rs, ar, act_elements, act) == 0.0


def test_an_moes_routed_experts_are_one_grouped_gemm_over_the_local_experts():
    """OLMoE (64 experts of 2048 x 1024, 8 a token), 1,024 tokens a rank: 8,192 routed rows. At EP 1
    each expert gets 128 rows and the grouped GEMM reads all 64 experts' weights, so it is bound by
    its bytes; EP 8 leaves 8 experts of 1,024 rows, bound by their FLOPs. (The experts were once
    priced as top_k dense GEMMs of the token rows, the same at every EP degree.) Under float8 this
    toolkit's routed experts stay in bf16; an engine whose grouped linears take the recipe pays
    float8's rate and its casts."""
    one, eight = (gpu.block_times(olmoe_job(ep), 1, K100) for ep in (1, 8))
    w1_w3 = 64 * 2 * ((128 * 2048 + 2048 * 1024) * 2 + 128 * 1024 * 2) / hbm(K100)
    assert one.tp_groups[2] == pytest.approx(w1_w3)  # no shared experts: the group is the routed w1 and w3
    assert one.tp_groups[2] > 2 * eight.tp_groups[2]
    flops = 2 * 2 * 8192 * 1024 * 2048  # w1 and w3, 8 experts in 512 tiles: 4 waves of 132 SMs
    assert eight.tp_groups[2] == pytest.approx(flops / (K100.matmul_tflops["bfloat16"] * 1e12 * 512 / 528))
    gpu_s = lambda t, phase: sum(t.kinds[phase].values())  # noqa: E731  (at 1,024 tokens the host bounds both)
    assert gpu_s(one, "fwd") > gpu_s(eight, "fwd") and gpu_s(one, "bwd") > gpu_s(eight, "bwd")
    half = gpu.block_times(olmoe_job(8), 1, dataclasses.replace(K100, grouped_gemm_share=0.5))  # as calibrated
    assert half.tp_groups[2] == pytest.approx(2 * eight.tp_groups[2]) and half.tp_groups[0] == eight.tp_groups[0]
    float8 = olmoe_job(8, "precision=float8", "compile.enable=true")
    ours, engines = gpu.block_times(float8, 1, K100), gpu.block_times(float8, 1, K100, Engine(float8_experts=True))
    assert ours.tp_groups[2] == pytest.approx(eight.tp_groups[2])
    assert engines.tp_groups[2] < 0.6 * ours.tp_groups[2]  # float8 at its share of twice the peak [mamf]
    # the step prices the engine it is given (at 1,024 tokens a rank float8's casts outweigh its GEMMs,
    # and on a host that kept up with the GPU: as priced, the host bounds both)
    quick_host = dataclasses.replace(K100, host_eager_s=0.0, host_compiled_s=0.0)
    h100 = dataclasses.replace(spec_profile(H100, 8, 8), kernels=quick_host)
    assert (predict_step(float8, h100, cuda=True, engine=Engine(float8_experts=True)).step_s
            != predict_step(float8, h100, cuda=True).step_s)


def test_an_moe_layers_host_ops_are_what_this_toolkits_layer_issues():
    """model_ops.Elementwise's MoE host ops counted on titan_exp's MoE layer, a training forward
    in bf16 on CPU: every op the dispatcher runs but a view, outside the experts (whose CUDA path,
    torch._grouped_mm, CPU does not take: GROUPED_EXPERT_OPS), and under expert parallel (a
    one-rank gloo group) what its exchange adds. A tiny MoE job's block is bound by its host, the
    MoE's ops in place of the SwiGLU's, and EP adds the exchange's, eager under compile too."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_exp.config.model import ModelConfig
    from titan_exp.models.moe import MoE

    layer = MoE(ModelConfig(dim=48, n_heads=4, n_experts=4, top_k=2, moe_hidden_dim=16)).to(torch.bfloat16)
    layer.init_buffers()
    ops, in_experts = [0], [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[0] += not (func.is_view or in_experts[0])
            return func(*args, **(kwargs or {}))

    def count():
        x, ops[0] = torch.randn(2, 20, 48, dtype=torch.bfloat16, requires_grad=True), 0
        with Count():
            layer(x)
        return ops[0]

    layer.experts.register_forward_pre_hook(lambda *_: in_experts.__setitem__(0, True))
    layer.experts.register_forward_hook(lambda *_: in_experts.__setitem__(0, False))
    ours = model_ops.LLAMA
    assert count() == ours.moe_ops[0] - model_ops.GROUPED_EXPERT_OPS
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        layer.tp_mesh = tp_mesh  # TP without EP (a slice of every expert's width): its gradient sums are views forward
        assert count() == ours.moe_ops[0] - model_ops.GROUPED_EXPERT_OPS
        layer.tp_mesh, layer.ep_mesh = None, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
        assert count() == ours.moe_ops[0] - model_ops.GROUPED_EXPERT_OPS + ours.ep_ops
        layer.tp_mesh = tp_mesh  # EP over TP's ranks too
        assert count() == ours.moe_ops[0] - model_ops.GROUPED_EXPERT_OPS + ours.ep_ops + ours.ep_tp_ops
    finally:
        dist.destroy_process_group()

    def tiny(ep, *more):
        return olmoe_job(ep, "training.seq_len=16", "model.n_layers=2", *more)
    host = K100.host_eager_s
    assert gpu.block_times(tiny(1), 1, K100).fwd == pytest.approx(
        (ours.eager_ops + ours.moe_ops[0] - ours.ffn_ops[0]) * host)
    assert gpu.block_times(tiny(8), 1, K100).fwd == pytest.approx(
        (ours.eager_ops + ours.moe_ops[0] - ours.ffn_ops[0] + ours.ep_ops) * host)
    compiled = gpu.block_times(tiny(8, "compile.enable=true"), 1, K100).fwd
    assert compiled == pytest.approx((ours.compiled_kernels + ours.moe_ops[1] - ours.ffn_ops[1]) * K100.host_compiled_s
                                     + ours.ep_ops * host)
    # An EP plan on a GPU says its all-to-all is priced optimistically (BENCHMARKS.md: NCCL's, published).
    optimistic = [[n for n in predict_step(tiny(ep), spec_profile(H100, 8, 8), cuda=True).notes if "all-to-all" in n]
                  for ep in (1, 8)]
    assert not optimistic[0] and "take EP layouts' times as optimistic" in optimistic[1][0]


def test_an_moes_dispatch_bytes_are_what_this_toolkits_moe_layer_moves():
    """Elementwise's dispatch defaults counted on titan_exp's MoE layer in bf16, eager: the bytes of
    every op outside the experts on tensors one `dim` wide, per routed row and per token (a
    gather's source read as the rows it picks, a zeroed tensor written only, an in-place op's
    target read and written), priced at HBM speed by block_times."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_exp.config.model import ModelConfig
    from titan_exp.models.moe import MoE

    dim, tokens, top_k = 48, 40, 2
    layer = MoE(ModelConfig(dim=dim, n_heads=4, n_experts=4, top_k=top_k, moe_hidden_dim=16)).to(torch.bfloat16)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer.init_buffers()
    moved, in_experts = {tokens: 0, tokens * top_k: 0}, [False]

    def add(t, times=1):  # a (rows, dim) tensor: its bytes, per token or per routed row
        if t.dim() == 2 and t.shape[1] == dim and t.shape[0] in moved:  # not the router's weight
            moved[t.shape[0]] += times * t.numel() * t.element_size()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if in_experts[0]:
                return out
            name = func.__name__.split(".")[0]
            ins, outs = ([a for a in torch.utils._pytree.tree_leaves(x) if isinstance(a, torch.Tensor)]
                         for x in ((args, kwargs), out))
            storages = {a.untyped_storage().data_ptr() for a in ins}
            if name == "mm" or name != "index_add_" and all(o.untyped_storage().data_ptr() in storages for o in outs):
                return out  # the router's GEMM, priced as one; a view
            if name == "index_add_":
                add(args[0], 2)
                add(args[3])
            elif name == "index":
                add(out, 2)  # reads the rows it picks, writes them
            else:
                for t in ([] if name == "zeros_like" else ins) + outs:
                    add(t)
            return out

    layer.experts.register_forward_pre_hook(lambda *_: in_experts.__setitem__(0, True))
    layer.experts.register_forward_hook(lambda *_: in_experts.__setitem__(0, False))
    with torch.no_grad(), Count():
        layer(torch.randn(2, tokens // 2, dim, dtype=torch.bfloat16))
    per_row, per_token = model_ops.LLAMA.dispatch_eager
    assert moved == {tokens * top_k: tokens * top_k * dim * per_row, tokens: tokens * dim * per_token}
    plain = model_ops.Elementwise(*dataclasses.astuple(model_ops.LLAMA)[:6], dispatch_eager=(0, 0))
    ep8, rows, toks = olmoe_job(8), 8192, 1024
    dispatch = 2048 * (rows * per_row + toks * per_token) / hbm(K100)
    gpu_only = dataclasses.replace(K100, host_eager_s=0.0)  # at 1,024 tokens a rank its host would bound it
    assert (gpu.block_times(ep8, 1, gpu_only).fwd - gpu.block_times(ep8, 1, gpu_only, Engine(elementwise=plain)).fwd
            == pytest.approx(dispatch))
    with_ep, without = (gpu.routed_experts(job, toks, K100, "bfloat16", "bfloat16", None, "torchao", model_ops.LLAMA)
                        for job in (ep8, olmoe_job(1)))
    assert with_ep.dispatch_bytes - without.dispatch_bytes == 2048 * rows * model_ops.EP_SORT_BYTES  # sorted and back


def test_per_op_selective_ac_recomputes_each_kind_of_blocks_own_every_other_matmul():
    """What the step model prices per-op selective AC as recomputing follows the policy's
    alternation over each block's matmuls in order (perf.model.shapes.block_matmuls, whose order
    tests/test_one_rank.py checks on the layers): OLMoE's MoE layer keeps q and v and its router
    (the 5th), recomputes k and o; DeepSeek-V3's MLA has five linears, so its MoE layers recompute
    the router and the shared expert's w3 and keep its w1 and w2, where its 3 dense blocks of 61
    recompute w1 and w2; the mean block's SwiGLU shares them by each kind's width."""
    from titan_exp.perf.model.shapes import ROUTER, selective_recomputed

    olmoe = selective_recomputed(olmoe_job(1).model)
    assert {name: share for name, share in olmoe.items() if share} == {"attention.wk": 1, "attention.wo": 1}
    m = compose_job(["model=deepseek_v3_671b"]).model
    dense, shared = 3 / 61 * 18432, 58 / 61 * 2048
    assert selective_recomputed(m) == pytest.approx({
        "attention.wq_a": 0, "attention.wq_b": 1, "attention.wkv_a": 0, "attention.wkv_b": 1, "attention.wo": 0,
        ROUTER: 58 / 61, "feed_forward.w1": dense / (dense + shared), "feed_forward.w3": shared / (dense + shared),
        "feed_forward.w2": dense / (dense + shared)})
