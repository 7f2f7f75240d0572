"""The GPU model from its parts (titan_exp/perf/gpu.py, issue 36): each part moves a prediction
by what it physically changes. Arithmetic only (seconds to run)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from titan_exp.config import compose_job
from titan_exp.perf import float8_casts as f8c
from titan_exp.perf import gpu, model_ops, overlap
from titan_exp.perf import kernel_rates as rates
from titan_exp.perf.devices import SPECS, load_hardware, spec_profile
from titan_exp.perf.profile import Kernels, Line, MachineProfile
from titan_exp.perf.placement import across_nodes, node_ranks
from titan_exp.perf.step import predict_step
from titan_exp.perf.step_comm import moe_tp_extra
from titan_exp.validation import resolve

pytestmark = pytest.mark.quick
H100 = SPECS["h100"]
K100 = rates.spec_kernels(H100, "flash")


def llama8b(*overrides: str):
    return resolve(compose_job(["model=llama3_8b", "precision=bf16", "training.seq_len=8192", "training.local_batch_size=2",
                                "training.global_batch_size=16", "parallelism.data_parallel_shard_degree=8",
                                "cluster.nproc_per_node=8", *overrides]))


def test_a_gemm_pays_for_its_last_wave_and_a_skinny_one_for_its_bytes():
    full = 132 * gpu.TILE  # one tile row per SM: one full wave
    assert gpu.wave_utilization(gpu.TILE, full, 132) == pytest.approx(1.0)
    assert gpu.wave_utilization(gpu.TILE, full + 1, 132) == pytest.approx((full + 1) / (2 * full))  # a second, near-empty wave
    per_flop = lambda n: gpu.gemm_s(K100, 12 * gpu.TILE, n, 8192, "bfloat16") / n  # noqa: E731
    assert per_flop(12 * gpu.TILE) > 1.8 * per_flop(11 * gpu.TILE)  # 144 tiles: two waves; 132: one
    skinny = gpu.gemm_s(K100, 8192, 8192, 16, "bfloat16")  # K = 16: reads and writes dominate
    assert skinny == pytest.approx((8192 * 16 * 2 + 16 * 8192 * 2 + 8192 * 8192 * 2) / gpu.hbm(K100))
    # float8 at its own measured share of twice the peak [mamf]: 70.9 % against bf16's 80.3 % on an H100
    f8, bf = (gpu.gemm_s(K100, 8192, 8192, 8192, dtype) for dtype in ("float8", "bfloat16"))
    assert f8 == pytest.approx(bf * (794.5 / 989) / (2 * 1402.6 / 1979), rel=1e-3) and 0.55 * bf < f8 < 0.6 * bf


def test_a_power_cap_slows_the_clock_not_the_memory():
    capped = SPECS["h100_500w"]
    ratio = ((500 - 70) / (700 - 70)) ** (1 / 3)
    assert rates.clock_ratio(capped) == pytest.approx(ratio) and rates.clock_ratio(H100) == 1.0
    same_hbm = rates.spec_kernels(dataclasses.replace(capped, memory_tb_s=H100.memory_tb_s))
    assert same_hbm.matmul_tflops["bfloat16"] == pytest.approx(ratio * K100.matmul_tflops["bfloat16"])
    assert gpu.hbm(same_hbm) == gpu.hbm(K100)
    big = gpu.gemm_s(same_hbm, 8192, 8192, 8192, "bfloat16") / gpu.gemm_s(K100, 8192, 8192, 8192, "bfloat16")
    assert big == pytest.approx(1 / ratio)


def test_attention_follows_flash_attentions_published_curve():
    fwd, bwd = K100.attention_fwd, K100.attention_bwd
    assert rates.attention_tflops(fwd, 8192) == pytest.approx(333)
    assert rates.attention_tflops(fwd, 3 * 1024) == pytest.approx(298 + (319 - 298) * 0.585, rel=1e-3)
    assert rates.attention_tflops(fwd, 256) == pytest.approx(191 / 2)
    assert rates.attention_tflops(bwd, 1 << 20) == pytest.approx(322)
    a100 = rates.spec_kernels(SPECS["a100"])
    assert rates.attention_tflops(a100.attention_fwd, 16384) == pytest.approx(rates.AMPERE_FA2_PEAK * 312)


def test_attention_is_priced_by_its_kernel_and_head_dim():
    cudnn, triton = rates.spec_kernels(H100, "cudnn"), rates.spec_kernels(H100, "triton")
    assert rates.attention_tflops(cudnn.attention_fwd, 8192) == pytest.approx(529)
    assert rates.attention_tflops(cudnn.attention_bwd, 16384) == pytest.approx(516)
    assert rates.attention_tflops(triton.attention_fwd, 8192) == pytest.approx(333 / rates.TRITON_SLOWDOWN)
    with pytest.raises(ValueError, match="'fa9'.*flash, cudnn, triton"):
        rates.spec_kernels(H100, "fa9")
    # unnamed, the kernel is the one torch's SDPA runs there [sdpa]: cuDNN's on Hopper and Blackwell
    assert rates.spec_kernels(H100).attention_fwd == cudnn.attention_fwd
    assert {name: rates.spec_kernels(SPECS[name]).attention_kernel for name in ("h200", "gb200", "a100")} == {
        "h200": "cudnn", "gb200": "cudnn", "a100": "flash"}
    assert spec_profile(SPECS["h100_500w"], 8, 8).kernels.attention_kernel == "cudnn"
    assert Kernels.of(cudnn.to_dict()).attention_kernel == "cudnn"  # a profile file says whose curves
    older = {k: v for k, v in K100.to_dict().items() if k != "attention_kernel"}
    assert Kernels.of(older).attention_kernel == "flash"  # a profile written before the field: SDPA's flash
    assert rates.head_dim_share(128, 64, 16384) == pytest.approx(299 / 335)
    assert rates.head_dim_share(64, 128, 512) == pytest.approx(191 / 180)  # a curve taken at 64, a model at 128
    assert rates.head_dim_share(128, 128, 4096) == rates.head_dim_share(64, 32, 4096) == 1.0

    def attention_s(kern, *overrides):  # a block's time less its time without attention's cost
        job = llama8b(*overrides)
        free = dataclasses.replace(kern, attention_fwd=((512, 1e12),), attention_bwd=((512, 1e12),))
        return sum(getattr(gpu.block_times(job, 1, kern), k) - getattr(gpu.block_times(job, 1, free), k) for k in ("fwd", "bwd"))

    flash = attention_s(K100)
    assert attention_s(cudnn) == pytest.approx(flash * 333 / 529, rel=0.03)  # fwd and bwd at 8k: ~1.6x faster
    assert attention_s(triton) == pytest.approx(flash * rates.TRITON_SLOWDOWN, rel=1e-6)
    heads_64 = ["model.n_heads=64", "model.n_kv_heads=16"]  # the same FLOPs at head dim 64
    assert attention_s(K100, *heads_64) == pytest.approx(flash * 333 / 295, rel=0.02)


def test_a_blackwell_gpu_takes_its_own_measured_attention_curves():
    """[cudnn-fe]: each Blackwell GPU's cuDNN and SDPA-flash curves as measured on it, not Hopper's
    shares of its peak (which would price FlashAttention-2 there at twice what it reaches)."""
    rate = lambda spec, kernel, seq, bwd=False: rates.attention_tflops(  # noqa: E731
        getattr(rates.spec_kernels(spec, kernel), "attention_bwd" if bwd else "attention_fwd"), seq)
    gb200, gb300, b200 = SPECS["gb200"], SPECS["gb300"], SPECS["b200"]
    assert rate(gb200, "cudnn", 8192) == pytest.approx(1646) and rate(gb300, "cudnn", 8192) == pytest.approx(1991)
    assert rate(gb200, "cudnn", 16384, bwd=True) == pytest.approx(1327)
    assert rate(gb300, "cudnn", 3 * 1024) == pytest.approx(1467 + (1813 - 1467) * math.log2(1.5), rel=1e-6)
    assert rate(b200, "cudnn", 8192) == pytest.approx(1646 * 2250 / 2500)  # GB200's at B200's peak
    assert rate(gb200, "flash", 8192) == pytest.approx(414)  # not 333/989.4 of 2,500 (841)
    assert rate(b200, "flash", 8192, bwd=True) == pytest.approx(299)
    b300 = SPECS["b300"]  # Blackwell Ultra at 1,100 W: GB300's curves at B300's peak, as B200's are GB200's
    assert rate(b300, "cudnn", 8192) == pytest.approx(1991 * 2250 / 2500)
    assert rate(b300, "flash", 8192, bwd=True) == pytest.approx(330 * 2250 / 2500)
    assert rate(gb200, "triton", 8192) == pytest.approx(414 / rates.TRITON_SLOWDOWN)
    capped = dataclasses.replace(gb200, power_limit_w=900.0)
    assert rate(capped, "cudnn", 8192) == pytest.approx(1646 * rates.clock_ratio(capped))
    # a GPU the benchmark did not measure keeps [fa3]'s shares of its peak: H100's own, a custom one's
    custom = dataclasses.replace(gb200, name="custom")
    assert rate(custom, "cudnn", 8192) == pytest.approx(529 / rates.H100_BF16 * 2500)
    assert rate(H100, "cudnn", 8192) == pytest.approx(529)


def test_a_small_model_is_bound_by_its_host_and_compile_fuses_memory_bound_kernels():
    tiny = resolve(compose_job(["training.seq_len=64", "training.local_batch_size=1", "training.global_batch_size=1"]))
    t = gpu.block_times(tiny, 1, K100)
    assert t.fwd == pytest.approx(model_ops.LLAMA.eager_ops * rates.HOST_EAGER_S) and t.bwd == pytest.approx(2 * t.fwd)
    compiled = gpu.block_times(dataclasses.replace(tiny, compile=dataclasses.replace(tiny.compile, enable=True)), 1, K100)
    assert compiled.fwd == pytest.approx(model_ops.LLAMA.compiled_kernels * rates.HOST_COMPILED_S)
    eager, fused = gpu.block_times(llama8b(), 1, K100), gpu.block_times(llama8b("compile.enable=true"), 1, K100)
    assert sum(eager.tp_groups) == sum(fused.tp_groups) and 1.1 < (eager.fwd + eager.bwd) / (fused.fwd + fused.bwd) < 1.5


def test_a_blocks_memory_bound_kernels_are_priced_as_its_model_runs_them():
    """perf.model_ops.Elementwise: the bytes per token a block's norms, adds, RoPE and activation move,
    and the loss's per logit, at HBM speed; Llama's by default, another model's when given."""
    job = llama8b()
    none = model_ops.Elementwise((0, 0, 0), (0, 0, 0), model_ops.LLAMA.eager_ops, model_ops.LLAMA.compiled_kernels, 0, 0)
    llama, free = gpu.block_times(job, 1, K100), gpu.block_times(job, 1, K100, none)
    tokens, d, qk, f = 2 * 8192, 4096, (32 + 8) * 128, 14336
    repeat_kv = tokens * 2 * (8 + 32) * 128 * 2  # GQA's K and V copied to every head: not the model's table
    moved = tokens * (model_ops.LLAMA.eager_bytes[0] * d + model_ops.LLAMA.eager_bytes[1] * qk + model_ops.LLAMA.eager_bytes[2] * f)
    assert llama.fwd - free.fwd == pytest.approx(moved / gpu.hbm(K100))
    assert llama.bwd - free.bwd == pytest.approx(2 * moved / gpu.hbm(K100))
    assert free.fwd - sum(free.tp_groups) > repeat_kv / gpu.hbm(K100)  # attention and the copy remain
    assert llama.head - free.head == pytest.approx(tokens * 128256 * model_ops.LLAMA.loss_bytes_eager / gpu.hbm(K100))
    assert predict_step(job, spec_profile(H100, 8, 8), cuda=True, elementwise=none).step_s < \
        predict_step(job, spec_profile(H100, 8, 8), cuda=True).step_s  # the step prices the block it is given


def test_llamas_eager_bytes_and_ops_are_what_this_toolkits_block_runs():
    """perf.model_ops.LLAMA counted on titan_exp's own block in bf16 (block_bytes): every aten op
    of its forward but the matmuls and attention, by the bytes it reads and writes (an expanded
    input once), the norms as the fused kernel a CUDA torch runs them with (on CPU they run as
    separate ops); and its kernels, the matmuls' and attention's among them."""
    m = compose_job(["model=debugmodel"]).model
    counted = block_bytes([], autocast=False)
    qk = (m.n_heads + m.kv_heads) * m.head_size
    repeat_kv = 2 * (m.kv_heads + m.n_heads) * m.head_size * 2  # GQA's K and V copied to every head (block_times)
    eager = model_ops.LLAMA.eager_bytes
    assert counted["fwd"] == eager[0] * m.dim + eager[1] * qk + eager[2] * m.ffn_hidden_dim + repeat_kv
    assert counted["kernels"] == model_ops.LLAMA.eager_ops


def test_mlas_eager_bytes_and_ops_are_what_its_block_runs():
    """perf.model_ops' MLA terms (mla_eager, mla_ops) counted the same way on the tiny DeepSeek-V3's
    dense block, its latents' norms as fused kernels, at shapes that move each term apart (heads,
    rotated width, latents; with and without the query latent); value heads as wide as query/key
    heads, where CPU's SDPA runs its flash kernel (narrower ones take its math path, whose ops are
    not a GPU's)."""
    from titan_exp.perf.gpu import latent_bytes

    dense = ["model=deepseek_v3_debug", "model.n_experts=0", "model.n_shared_experts=0", "model.n_dense_layers=0"]
    for heads, rope, latent, query in ((8, 32, 64, 128), (16, 32, 64, 128), (8, 64, 128, 128), (8, 32, 64, 0)):
        shape = [f"model.n_heads={heads}", f"model.qk_rope_head_dim={rope}", f"model.v_head_dim={32 + rope}",
                 f"model.kv_lora_rank={latent}", f"model.q_lora_rank={query}"]
        m = compose_job(["model=debugmodel", *dense, *shape]).model
        counted = block_bytes([*dense, *shape], autocast=False)
        eager = model_ops.LLAMA.eager_bytes
        assert counted["fwd"] == pytest.approx(eager[0] * m.dim + eager[2] * m.ffn_hidden_dim
                                               + latent_bytes(m, 1, model_ops.LLAMA.mla_eager, 2))
        assert counted["kernels"] == model_ops.LLAMA.eager_ops + model_ops.LLAMA.mla_ops[0][bool(query)]


def block_bytes(overrides: list[str], autocast: bool, seq: int = 48) -> dict[str, float]:
    """What this toolkit's block (debugmodel, with `overrides`) runs, forward and backward: bytes a
    token moved by memory-bound ops (every aten op but views, matmuls and attention, by what it
    reads and writes, an expanded input once; the norms' forward as the fused kernel a CUDA torch
    runs, their backward as CPU runs it), fwd and bwd; bytes a parameter of its weights' casts,
    weights_fwd and weights_bwd; and its forward's kernels (every op but views, a norm one). In
    bf16, or fp32 under CPU bf16 autocast. Weight casts are the casts of a parameter forward and
    casts to a parameter's shape backward (no activation has one at this sequence length)."""
    import torch

    from titan_exp.models.llama import TransformerBlock, rope_tables

    m = compose_job(["model=debugmodel", *overrides]).model
    block = TransformerBlock(m) if autocast else TransformerBlock(m).to(torch.bfloat16)
    cos, sin = rope_tables(m.rope_dim, seq, m.rope_theta)
    x = torch.randn(2, seq, m.dim, dtype=torch.float32 if autocast else torch.bfloat16, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return [block(x, cos, sin)]

    norms = [module for module in block.modules() if isinstance(module, torch.nn.RMSNorm)]  # MLA's latents' too
    return moved_bytes(forward, norms, list(block.parameters()), (cos, sin), 2 * seq)


def moved_bytes(forward, norms, params, tables, tokens: int) -> dict[str, float]:
    """block_bytes' counts of what `forward()` (returning its outputs) and then their backward run,
    per token (rows) and per parameter of `params` (their casts), `norms` counted as a CUDA torch's
    fused kernel forward, the RoPE `tables` (per position, not per token) left out."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    owned, shapes = {p.untyped_storage().data_ptr() for p in params}, {tuple(p.shape) for p in params}
    tables = {t.untyped_storage().data_ptr() for t in tables}
    moved, in_norm = {"rows": 0, "weights": 0, "kernels": 0}, [0]

    def physical(t):  # an expanded dimension (stride 0) is read once
        return math.prod(n for n, st in zip(t.shape, t.stride()) if st) * t.element_size()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            if in_norm[0] or all(o.untyped_storage().data_ptr() in {a.untyped_storage().data_ptr() for a in ins}
                                 for o in outs):  # inside a fused norm, or a view
                return out
            moved["kernels"] += 1
            name = func.__name__.split(".")[0]
            if name in ("mm", "_scaled_dot_product_flash_attention_for_cpu",
                        "_scaled_dot_product_flash_attention_for_cpu_backward"):
                return out
            size = sum(physical(t) for t in ins + outs if t.untyped_storage().data_ptr() not in tables)
            weight = name == "_to_copy" and (ins[0].untyped_storage().data_ptr() in owned or tuple(outs[0].shape) in shapes)
            moved["weights" if weight else "rows"] += size
            return out

    def enter(_module, args):  # a CUDA torch's fused norm forward reads the row and writes it
        in_norm[0] += 1
        moved["rows"] += 2 * physical(args[0])
        moved["kernels"] += 1

    for norm in norms:
        norm.register_forward_pre_hook(enter)
        norm.register_forward_hook(lambda *_: in_norm.__setitem__(0, in_norm[0] - 1))
    with Count():
        outs = forward()
    counted = dict(moved)
    grads = [torch.randn_like(o) for o in outs]
    with Count():
        torch.autograd.backward(outs, grads)
    n = sum(p.numel() for p in params)
    return {"fwd": counted["rows"] / tokens, "bwd": (moved["rows"] - counted["rows"]) / tokens,
            "weights_fwd": counted["weights"] / n, "weights_bwd": (moved["weights"] - counted["weights"]) / n,
            "kernels": counted["kernels"]}


def test_calibration_times_the_blocks_own_memory_bound_ops_against_the_bytes_priced():
    """measure_kernels.elementwise_block runs the memory-bound ops of this toolkit's block and moves
    what the block does, counted the same way on both (debugmodel in bf16): the same forward
    kernels but the block's seven matmuls and its attention, the same bytes a token forward
    (perf.model_ops.LLAMA's, with GQA's repeat), backward within 2 % (1 % more: one copy the
    block's backward does not make). So the rate calibration divides those bytes by
    (elementwise_tb_s, positive here on one gloo rank) is the rate of the bytes block_times prices."""
    import torch
    import torch.distributed as dist

    from titan_exp.perf import measure_kernels as mk
    from titan_exp.perf.timing import Options

    m, seq = compose_job(["model=debugmodel"]).model, 48
    part = mk.elementwise_block(m, seq, torch.bfloat16, torch.device("cpu"))
    ops = moved_bytes(part.forward, part.norms, [p for n in part.norms for p in n.parameters()], part.tables, seq)
    whole = block_bytes([], autocast=False, seq=seq)
    assert ops["kernels"] + 8 == whole["kernels"]
    assert ops["fwd"] == whole["fwd"] and ops["bwd"] == pytest.approx(whole["bwd"], rel=0.02)
    qk = (m.n_heads + m.kv_heads) * m.head_size
    eager = model_ops.LLAMA.eager_bytes
    assert ops["fwd"] == eager[0] * m.dim + eager[1] * qk + eager[2] * m.ffn_hidden_dim + 2 * qk * 2
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert mk.elementwise_tb_s(m, seq, torch.float32, Options(tiny=True), torch.device("cpu"), compiled=False) > 0
    finally:
        dist.destroy_process_group()


def test_calls_timed_back_to_back_are_timed_per_call_with_one_wait(monkeypatch):
    """timing.queued, by which calibration times the block's memory-bound ops: one warm-up call,
    then `reps` calls with no wait between them, and the mean a call (not the sum, not a median
    of calls each waited on)."""
    import time

    import torch

    from titan_exp.perf import timing

    calls, waits = [], []

    def work():
        calls.append(time.perf_counter())
        time.sleep(0.07 if len(calls) == 4 else 0.01)  # 10 ms (the warm-up, not timed), 10, 10, 70

    monkeypatch.setattr(timing, "sync", lambda device: waits.append(len(calls)))
    seconds = timing.queued(work, 3, torch.device("cpu"))
    assert len(calls) == 4 and waits == [1, 4]
    assert 0.03 <= seconds < 0.05  # the mean; the median would be 10 ms, the sum 90


@pytest.mark.parametrize("query_latent", [128, 0])
def test_calibration_times_an_mla_blocks_own_memory_bound_ops(query_latent):
    """For a model with multi-head latent attention, measure_kernels.elementwise_block runs the
    ops of its block (latent_elementwise_block): counted the same way as the tiny DeepSeek-V3's
    dense block, the same forward bytes (block_times' for it: Llama's norms, adds and SwiGLU, and
    the mla_eager terms), backward within 2 %, and the same kernels but its GEMMs and attention;
    so the rate calibration divides by them is the rate of the bytes block_times prices. (Value
    heads as wide as query/key ones: CPU's SDPA then runs its flash kernel.)"""
    import torch

    from titan_exp.perf import measure_kernels as mk
    from titan_exp.perf.gpu import latent_bytes, memory_bound_bytes

    shape = ["model=deepseek_v3_debug", "model.n_experts=0", "model.n_shared_experts=0", "model.n_dense_layers=0",
             "model.v_head_dim=64", f"model.q_lora_rank={query_latent}"]
    m, seq = compose_job(["model=debugmodel", *shape]).model, 48
    part = mk.elementwise_block(m, seq, torch.bfloat16, torch.device("cpu"))
    ops = moved_bytes(part.forward, part.norms, [p for n in part.norms for p in n.parameters()], part.tables, seq)
    whole = block_bytes(shape, autocast=False, seq=seq)
    gemms = 6 + (2 if query_latent else 1)  # wkv_a, wkv_b, wo, w1, w3, w2; and wq, or wq_a and wq_b
    assert ops["kernels"] + gemms + 1 == whole["kernels"]  # and attention
    assert ops["fwd"] == whole["fwd"] and ops["bwd"] == pytest.approx(whole["bwd"], rel=0.02)
    priced = memory_bound_bytes(model_ops.LLAMA.eager_bytes, 1, 2, m.dim, 0, 0, m.head_size, m.ffn_hidden_dim)
    assert ops["fwd"] == priced + latent_bytes(m, 1, model_ops.LLAMA.mla_eager, 2)


def test_autocasts_casts_and_fp32_stream_are_what_this_toolkits_block_moves():
    """model_ops.Elementwise.autocast_bytes and autocast_weight_bytes counted on titan_exp's own
    block, fp32 under bf16 autocast (a single GPU's run) against the same block in bf16: 46 bytes a
    token per unit of dim more forward and 48 backward, at two widths of dim (not of the SwiGLU's
    or the heads'); each weight cast to bf16 forward and its gradient to fp32 backward, 6 bytes a
    parameter each (the norms' weights, never cast, keep it just under)."""
    forward, backward = model_ops.LLAMA.autocast_bytes
    cast_fwd, cast_bwd = model_ops.LLAMA.autocast_weight_bytes
    for overrides in ([], ["model.dim=512"], ["model.ffn_dim_multiplier=2.0"]):
        dim = compose_job(["model=debugmodel", *overrides]).model.dim
        bf16, autocast = block_bytes(overrides, False), block_bytes(overrides, True)
        assert autocast["fwd"] - bf16["fwd"] == pytest.approx(forward * dim, rel=1e-3), overrides
        assert autocast["bwd"] - bf16["bwd"] == pytest.approx(backward * dim, rel=1e-3), overrides
        assert (bf16["weights_fwd"], bf16["weights_bwd"]) == (0, pytest.approx(0, abs=0.01))
        assert 0.99 * cast_fwd < autocast["weights_fwd"] <= cast_fwd and 0.99 * cast_bwd < autocast["weights_bwd"] <= cast_bwd


def test_a_single_gpus_step_pays_for_autocasts_casts():
    """perf.gpu prices autocast's work where a replica runs under it (perf.memory_gpu.autocast_replica)
    and nowhere else: eager, its rows' bytes and its weights' casts; compiled, its weights' casts
    alone (Inductor fuses the rest: not counted); a float8 block's weights no cast to bf16 forward
    (torchao casts them from fp32), their gradients' all the same; the output layer, bf16 under
    either, both; under FSDP, which casts the parameters, none."""
    job = llama8b("training.local_batch_size=1", "training.global_batch_size=1", "parallelism.data_parallel_shard_degree=1",
                  "cluster.nproc_per_node=1")
    sharded = llama8b()
    k, hbm = K100, gpu.hbm(K100)
    tokens, dim, weights = 8192, 4096, job.model.block_matmul_params(1)
    rows = dict(zip(("fwd", "bwd"), model_ops.LLAMA.autocast_bytes))
    cast = dict(zip(("fwd", "bwd"), model_ops.LLAMA.autocast_weight_bytes))
    none = dataclasses.replace(model_ops.LLAMA, autocast_bytes=(0, 0), autocast_weight_bytes=(0, 0))
    for precision, compiled in itertools.product(("bf16", "float8"), (False, True)):
        on = llama8b_like(dataclasses.replace(job, precision=compose_job([f"precision={precision}"]).precision), compiled)
        priced, bare = gpu.block_times(on, 1, k), gpu.block_times(on, 1, k, none)
        for phase in ("fwd", "bwd"):
            cast_weights = 0 if (precision, phase) == ("float8", "fwd") else weights
            extra = (0 if compiled else tokens * dim * rows[phase]) + cast_weights * cast[phase]
            assert priced.kinds[phase]["memory_bound"] - bare.kinds[phase]["memory_bound"] == pytest.approx(extra / hbm)
        assert priced.head - bare.head == pytest.approx(128256 * dim * (cast["fwd"] + cast["bwd"]) / hbm)
    off = llama8b_like(sharded, False)
    assert gpu.block_times(off, 1, k).kinds == gpu.block_times(off, 1, k, none).kinds


def llama8b_like(job, compiled: bool):
    return dataclasses.replace(job, compile=dataclasses.replace(job.compile, enable=compiled))


def test_float8_recipes_pay_for_their_casts_and_their_gemms():
    def step(*o: str) -> float:
        job = llama8b("precision=float8", "compile.enable=true", *o)
        return predict_step(job, spec_profile(H100, 8, 8), cuda=True).step_s

    bf16 = predict_step(llama8b("compile.enable=true"), spec_profile(H100, 8, 8), cuda=True).step_s
    tensorwise, rowwise = step(), step("precision.float8_recipe=rowwise")
    high_gw = step("precision.float8_recipe=rowwise_with_gw_hp")
    assert tensorwise < rowwise < high_gw < bf16
    notes = gpu.block_times(llama8b("precision=float8"), 1, rates.spec_kernels(SPECS["a100"])).notes
    assert notes == ["this GPU has no FP8 tensor cores: float8 at bfloat16"]


def test_torchaos_shape_filter_keeps_small_linears_in_bf16_in_the_model_and_the_plan():
    """precision.filter_fqns's auto_filter_small_kn (TorchTitan's name for torchao's float8 shape
    filter): the 1B's linears the converter swaps, torchao's Float8Linear on a real meta model, are
    those the planner prices in float8; a model whose every linear the filter keeps is priced as
    bf16; without the filter nothing changes."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    from titan_exp.models.llama import Transformer
    from titan_exp.perf.memory_gpu import float8_tensors
    from titan_exp.perf.shapes import low_precision_linears
    from titan_exp.precision import apply_converter

    auto = "precision.filter_fqns=[output,auto_filter_small_kn]"
    expected = {"float8": {"attention.wq", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"},
                "float8_rowwise": {"feed_forward.w1", "feed_forward.w3"}}  # the 1B: K, N <= 2048 stay bf16 under rowwise
    for preset, names in expected.items():
        job = resolve(compose_job(["model=llama3_1b", "model.n_layers=1", f"precision={preset}", auto]))
        with torch.device("meta"):
            model = Transformer(job.model)
        apply_converter(model, job.precision)
        swapped = {fqn.removeprefix("layers.0.") for fqn, m in model.named_modules() if isinstance(m, Float8Linear)}
        assert swapped == names == low_precision_linears(job)
        plain = resolve(compose_job(["model=llama3_1b", f"precision={preset}"]))
        assert len(low_precision_linears(plain)) == 7
    named = resolve(compose_job(["model=llama3_1b", "precision=float8", "precision.filter_fqns=[output,attention]"]))
    assert low_precision_linears(named) == {"feed_forward.w1", "feed_forward.w3", "feed_forward.w2"}
    # The output layer: high precision as named by default; in float8 (its GEMMs and casts) where the list leaves it.
    default, head8 = (resolve(compose_job(["model=llama3_1b", "precision=float8", *o]))
                      for o in ([], ["precision.filter_fqns=[]"]))
    bf16 = gpu.block_times(resolve(compose_job(["model=llama3_1b", "precision=bf16"])), 1, K100)
    assert gpu.block_times(default, 1, K100).kinds["head"] == bf16.kinds["head"]
    head = gpu.block_times(head8, 1, K100).kinds["head"]  # float8 GEMMs, and the casts' bytes beside the loss's
    assert head["gemm"] < bf16.kinds["head"]["gemm"] and head["memory_bound"] > bf16.kinds["head"]["memory_bound"]
    # The 1B under rowwise with the filter: q, k, v and o priced as bf16's, w1 and w3 in float8.
    rowwise = gpu.block_times(resolve(compose_job(["model=llama3_1b", "precision=float8_rowwise", auto])), 1, K100)
    assert rowwise.tp_groups[:2] == bf16.tp_groups[:2] and rowwise.tp_groups[2] != bf16.tp_groups[2]
    kept_all = resolve(compose_job(["model=debugmodel", "precision=float8", auto]))  # every K <= 4096 and N <= 1024
    assert low_precision_linears(kept_all) == frozenset() and float8_tensors(kept_all, 1024) == []
    plain16 = resolve(compose_job(["model=debugmodel", "precision=bf16"]))
    for k in ("fwd", "bwd", "head"):
        assert getattr(gpu.block_times(kept_all, 1, K100), k) == pytest.approx(getattr(gpu.block_times(plain16, 1, K100), k))


@pytest.mark.parametrize("recipe", sorted(f8c.EAGER_CAST_KERNELS))
def test_eager_float8_casts_are_what_torchaos_linear_runs(recipe):
    """[torchao-eager] counted on torchao's own Float8Linear, forward and backward on CPU: every
    op on plain tensors but views, by the bytes it reads and writes. Each cast of a bf16 tensor is
    EAGER_CAST_KERNELS[recipe] kernels and EAGER_CAST_BYTES an element of it; the forward casts the
    input and the weight; the backward the output gradient twice and the weight and the input
    again (rowwise_with_gw_hp: the gradient once and the weight), as _cast_bytes prices them. The
    matmuls (through torchao's tensor subclass, or plain in bf16) are GEMMs, not counted here."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    rows, k, n = 256, 512, 1024
    linear = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(linear, config=Float8LinearConfig.from_recipe_name(recipe))
    x = torch.randn(rows, k, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, n, dtype=torch.bfloat16)
    kernels, moved = [0], [0]

    def physical(t):
        return math.prod(d for d, st in zip(t.shape, t.stride()) if st) * t.element_size()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
            if any(type(t) is not torch.Tensor for t in ins + outs):  # torchao's subclass: its matmul, its views
                return out
            if outs and {o.untyped_storage().data_ptr() for o in outs} <= {a.untyped_storage().data_ptr() for a in ins}:
                return out  # a view
            if func.__name__.split(".")[0] in ("mm", "_scaled_mm"):  # a GEMM (gw_hp's weight gradient in bf16)
                return out
            kernels[0] += 1
            if max(t.numel() for t in ins + outs) >= rows * k:  # a tensor's cast, not its scale's arithmetic
                moved[0] += sum(physical(t) for t in ins + outs)
            return out

    def count(fn):
        kernels[0] = moved[0] = 0
        with Count():
            fn()
        return kernels[0], moved[0]

    linear(x).backward(grad)  # once outside, so no first-call work is counted
    out = []
    fwd_kernels, fwd_bytes = count(lambda: out.append(linear(x)))
    bwd_kernels, bwd_bytes = count(lambda: out[0].backward(grad))
    per_cast, casts_back = f8c.EAGER_CAST_KERNELS[recipe], 2 if recipe == "rowwise_with_gw_hp" else 4
    assert (fwd_kernels, bwd_kernels) == (2 * per_cast, casts_back * per_cast)
    # within 1 %: the casts' reads of their scales (a scalar, or a row's or column's) are not priced
    assert fwd_bytes == pytest.approx(f8c.EAGER_CAST_BYTES * (rows * k + k * n), rel=1e-2)
    rescaled = {"rowwise": rows * k + k * n, "rowwise_with_gw_hp": rows * k}.get(recipe, 0)
    assert fwd_bytes + bwd_bytes + rescaled * f8c.RESCALE_BYTES["torchao"] == pytest.approx(
        f8c.cast_bytes(rows * k, k * n, rows * n, recipe, "torchao"), rel=1e-2)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchaos_linear_under_autocast_casts_its_fp32_weight_and_its_gradients(recipe):
    """A single GPU's float8 linear: torchao's Float8Linear with an fp32 weight, its input fp32
    under bf16 autocast (CPU's), against the same linear in bf16. Forward, its casts move as many
    bytes (the fp32 weight cast to float8 at once, the input cast to bf16 by torchao as by
    autocast); backward, 6 bytes more a weight element and 6 more an input element, their
    gradients cast to fp32: Elementwise.autocast_weight_bytes's backward for every linear, and no
    forward weight cast beside the float8 one (perf.gpu)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    rows, k, n = 256, 512, 1024

    def moved(fp32: bool) -> dict[str, float]:
        linear = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
        linear = linear if fp32 else linear.to(torch.bfloat16)
        convert_to_float8_training(linear, config=Float8LinearConfig.from_recipe_name(recipe))
        x = torch.randn(rows, k, dtype=torch.float32 if fp32 else torch.bfloat16, requires_grad=True)
        grad = torch.randn(rows, n, dtype=torch.bfloat16)
        by = {"weight": 0, "input": 0}

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
                if any(type(t) is not torch.Tensor for t in tensors) or func.__name__.split(".")[0] in ("mm", "_scaled_mm"):
                    return out  # torchao's subclass (its matmul, its views), or a GEMM
                if {o.untyped_storage().data_ptr() for o in outs} <= {
                        t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor)}:
                    return out  # a view
                largest = max(t.numel() for t in tensors)
                if largest >= rows * k:  # a tensor's cast, not its scale's arithmetic
                    by["weight" if largest == k * n else "input"] += sum(
                        math.prod(d for d, st in zip(t.shape, t.stride()) if st) * t.element_size() for t in tensors)
                return out

        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=fp32):
            linear(x).backward(grad)  # once, so no first-call work is counted
            linear.zero_grad(set_to_none=True)  # and a first microbatch's backward, no gradient to add to
            x.grad = None
            with Count():
                y = linear(x)
        forward = dict(by)
        with Count():
            y.backward(grad)
        return {"weight_fwd": forward["weight"] / (k * n), "input_fwd": forward["input"] / (rows * k),
                "weight_bwd": (by["weight"] - forward["weight"]) / (k * n),
                "input_bwd": (by["input"] - forward["input"]) / (rows * k)}

    bf16, autocast = moved(False), moved(True)
    assert autocast["weight_fwd"] == pytest.approx(bf16["weight_fwd"], rel=1e-3)
    assert autocast["input_fwd"] == pytest.approx(bf16["input_fwd"], rel=1e-3)
    assert autocast["weight_bwd"] - bf16["weight_bwd"] == pytest.approx(model_ops.LLAMA.autocast_weight_bytes[1], abs=0.05)
    assert autocast["input_bwd"] - bf16["input_bwd"] == pytest.approx(6, abs=0.1)


def test_a_rowwise_backward_gemm_rescales_its_output_after_tensorwise_cublas():
    """Without fast accumulation (torchao's rowwise backward GEMMs), addmm_float8_unwrapped runs
    the tensorwise GEMM and multiplies its bf16 output by the outer product of the row and column
    scales: counted on CPU, RESCALE_BYTES["torchao"] an output element, beside the GEMM."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8.float8_ops import addmm_float8_unwrapped

    m, k, n = 512, 128, 2048
    a, b = torch.randn(m, k).to(torch.float8_e4m3fn), torch.randn(n, k).to(torch.float8_e4m3fn).t()
    moved = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] != "_scaled_mm":  # the GEMM itself is priced as one
                tensors = torch.utils._pytree.tree_leaves((args, kwargs, out))
                moved[0] += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            return out

    with Count():
        addmm_float8_unwrapped(a, torch.rand(m, 1) + 1, b, torch.rand(1, n) + 1, torch.bfloat16, use_fast_accum=False)
    assert moved[0] == pytest.approx(f8c.RESCALE_BYTES["torchao"] * m * n, rel=1e-2)  # the scales' own bytes aside


def test_a_measured_forward_rate_prices_the_forward_float8_gemms_alone():
    """Where calibration measured torch._scaled_mm as torchao's forward GEMMs run (fast
    accumulation: `float8_fast`, tensorwise; `float8_rowwise`, rowwise scales), a float8 linear's
    forward GEMM runs at its recipe's rate; its backward GEMMs (tensorwise cuBLAS without fast
    accumulation in torchao) keep the float8 rate, and a bf16 linear under a float8 recipe (an
    MoE's routed experts) its bf16 one. A spec sheet has neither rate."""
    assert not {"float8_rowwise", "float8_fast"} & set(K100.matmul_tflops)
    rows, k, n = 8192.0, 4096.0, 14336.0
    for key, recipes in (("float8_rowwise", ("rowwise", "rowwise_with_gw_hp")), ("float8_fast", ("tensorwise",))):
        half = dataclasses.replace(K100, matmul_tflops={**K100.matmul_tflops, key: K100.matmul_tflops["float8"] / 2})
        for recipe in ("rowwise", "rowwise_with_gw_hp", "tensorwise"):
            before, after = (gpu.linear_s(kern, rows, k, n, "float8", "bfloat16", recipe, "compiled") for kern in (K100, half))
            assert after[1:] == before[1:]
            assert after[0] == pytest.approx(2 * before[0] if recipe in recipes else before[0], rel=1e-3)
            bf16 = [gpu.linear_s(kern, rows, k, n, "bfloat16", "bfloat16", recipe, "compiled") for kern in (K100, half)]
            assert bf16[0] == bf16[1]


def test_calibration_times_float8_gemms_as_torchaos_linear_runs_them(monkeypatch):
    """measure_kernels.FLOAT8_GEMMS is what torchao's Float8LinearConfig asks cuBLAS for, recipe
    by recipe (fast accumulation in the forward GEMM, none in the gradients'), and
    matmul_tflops times each with those arguments where the device has float8 (on this CPU, with
    float8 allowed and torch._scaled_mm recorded)."""
    import torch
    import torch.distributed as dist
    from torchao.float8 import Float8LinearConfig

    from titan_exp.perf import measure_kernels as mk
    from titan_exp.perf.timing import Options

    for recipe, forward in (("tensorwise", "float8_fast"), ("rowwise", "float8_rowwise"), ("rowwise_with_gw_hp", "float8_rowwise")):
        config = Float8LinearConfig.from_recipe_name(recipe)
        assert config.gemm_config_output.use_fast_accum == mk.FLOAT8_GEMMS[forward][1]
        assert config.gemm_config_grad_input.use_fast_accum == mk.FLOAT8_GEMMS["float8"][1]
        assert config.gemm_config_grad_weight.use_fast_accum == mk.FLOAT8_GEMMS["float8"][1]
    calls, scaled_mm = [], torch._scaled_mm

    def recorded(a, b, scale_a, scale_b, **kw):
        calls.append((scale_a.numel() > 1, kw["use_fast_accum"]))
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", recorded)
    monkeypatch.setattr(mk, "matmul_dtypes", lambda device: [torch.bfloat16, torch.float8_e4m3fn])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rates = mk.matmul_tflops([64], 1, Options(tiny=True), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert set(rates) == {"bfloat16", *mk.FLOAT8_GEMMS} and all(r > 0 for r in rates.values())
    assert set(calls) == set(mk.FLOAT8_GEMMS.values())
    # A GPU whose cuBLAS refuses fast accumulation keeps the float8 rate for the forward GEMMs too.
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("no fast accum"))
                        if kw["use_fast_accum"] else scaled_mm(*a, **kw))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert set(mk.matmul_tflops([64], 1, Options(tiny=True), torch.device("cpu"))) == {"bfloat16", "float8"}
    finally:
        dist.destroy_process_group()


def test_float8_casts_are_priced_at_the_rate_calibration_measured_for_them():
    """A float8 block's casts run at Kernels.float8_cast_tb_s's rate for its recipe and casts (the
    memory rate where none was measured): at half the memory rate they take twice as long, at a
    quarter four times, and nothing else of the block moves; rowwise_with_gw_hp takes rowwise's."""
    def kinds(job, rates):
        kern = dataclasses.replace(K100, float8_cast_tb_s=rates)
        t = gpu.block_times(job, 1, kern)
        return {k: sum(part.get(k, 0.0) for part in t.kinds.values()) for k in ("gemm", "attention", "memory_bound")}

    hbm = K100.memory_tb_s
    for recipe, compiled in (("tensorwise", True), ("rowwise", False), ("rowwise_with_gw_hp", True)):
        job = llama8b("precision=float8", f"precision.float8_recipe={recipe}", f"compile.enable={str(compiled).lower()}")
        key = f"{'rowwise' if recipe != 'tensorwise' else recipe}/{'compiled' if compiled else 'torchao'}"
        base, same = kinds(job, {}), kinds(job, {key: hbm})
        half, quarter = kinds(job, {key: hbm / 2}), kinds(job, {key: hbm / 4})
        other = kinds(job, {f"tensorwise/{'torchao' if compiled else 'compiled'}": hbm / 4})  # another mode's rate
        assert same == base and other == base
        assert half["gemm"] == base["gemm"] and half["attention"] == base["attention"]
        cast = half["memory_bound"] - base["memory_bound"]
        assert cast > 0 and quarter["memory_bound"] - base["memory_bound"] == pytest.approx(3 * cast, rel=1e-9)
    measured = dataclasses.replace(K100, float8_cast_tb_s={"tensorwise/compiled": 0.9})
    assert Kernels.of(json.loads(json.dumps(measured.to_dict()))) == measured  # as a profile's file keeps it
    assert Kernels.of({k: v for k, v in K100.to_dict().items() if k != "float8_cast_tb_s"}) == K100  # a file from before


def test_calibration_measures_torchaos_float8_casts_where_float8_runs(monkeypatch):
    """measure_kernels.float8_cast_tb_s on this CPU (torchao's float8 linear runs here, its matmul
    emulated), with a float8 GEMM rate in the kernels as on an FP8 GPU: a rate for each recipe and
    mode asked, the float8 linear's step less its GEMMs priced at those kernels; none without a
    float8 rate (a GPU without FP8 tensor cores, or this CPU as calibration measures it)."""
    import torch
    import torch.distributed as dist

    from titan_exp.perf import measure_kernels as mk
    from titan_exp.perf.timing import Options

    m = llama8b("model=debugmodel").model
    slow_gemms = dataclasses.replace(K100, matmul_tflops={k: 1e-3 for k in K100.matmul_tflops})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rates = mk.float8_cast_tb_s(K100, m, 256, Options(tiny=True), torch.device("cpu"), ("torchao",))
        none = mk.float8_cast_tb_s(dataclasses.replace(K100, matmul_tflops={"bfloat16": 1.0}), m, 256, Options(tiny=True),
                                   torch.device("cpu"), ("torchao",))
        # GEMMs priced slower than the whole linear ran: no remainder to be the casts', no rate
        left_out = mk.float8_cast_tb_s(slow_gemms, m, 256, Options(tiny=True), torch.device("cpu"), ("torchao",))
    finally:
        dist.destroy_process_group()
    assert set(rates) == {"tensorwise/torchao", "rowwise/torchao"} and all(0 < r < 1 for r in rates.values())
    assert none == {} and left_out == {}


def test_calibration_times_the_optimizer_phase_on_the_models_own_tensors(monkeypatch):
    """On a GPU, calibration times the optimizer phase as a step runs it (measure_compute.
    optimizer_phase: gradient norm, clipping and AdamW over the model's own tensors, in its order,
    up to `room` parameters), not AdamW over square matrices; on CPU here, one gloo rank."""
    import torch
    import torch.distributed as dist

    from titan_exp.models.llama import Transformer
    from titan_exp.perf.measure_compute import optimizer_phase
    from titan_exp.perf.timing import Options

    m = compose_job(["model=debugmodel"]).model
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in Transformer(m).parameters()]
    stepped, norms, adamw = [], [], torch.optim.AdamW

    class Recording(adamw):
        def step(self, closure=None):
            stepped.append([tuple(p.shape) for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda grads, **kw: norms.append(len(grads)) or torch.ones(()))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        whole = optimizer_phase(m, Options(tiny=True), torch.device("cpu"), room=10**12)
        assert whole > 0 and stepped[-1] == shapes and norms[-1] == len(shapes)
        optimizer_phase(m, Options(tiny=True), torch.device("cpu"), room=1)  # one tensor at least
        assert stepped[-1] == shapes[:1]
    finally:
        dist.destroy_process_group()


def test_an_eager_float8_block_pays_for_torchaos_casts_and_python_on_the_host():
    """Without compile, each of a block's seven float8 linears adds its casts' kernels and
    torchao's Python (HOST_FLOAT8_S, or what calibrate measured) to the block's host time; its
    casts move EAGER_CAST_BYTES an element. So on a small model a float8 block is slower than a
    bf16 one, where compiled it is faster [torchao-eager]."""
    small = ("model=llama3_1b", "training.local_batch_size=1")
    eager8, eager16 = (gpu.block_times(llama8b(*small, *o), 1, K100) for o in (["precision=float8"], []))
    host = model_ops.LLAMA.eager_ops * K100.host_eager_s + 7 * (2 * 11 * K100.host_eager_s + f8c.HOST_FLOAT8_S)
    assert eager8.fwd == pytest.approx(host) and eager8.bwd == pytest.approx(2 * host)  # host-bound
    assert eager8.fwd + eager8.bwd > 2 * (eager16.fwd + eager16.bwd)
    measured = dataclasses.replace(K100, host_float8_s=0.0)
    assert gpu.block_times(llama8b(*small, "precision=float8"), 1, measured).fwd < eager8.fwd
    compiled8, compiled16 = (gpu.block_times(llama8b(*small, "compile.enable=true", *o), 1, K100)
                             for o in (["precision=float8"], []))
    assert compiled8.fwd + compiled8.bwd < compiled16.fwd + compiled16.bwd
    assert [n for n in eager8.notes if "compile.enable=true fuses the casts" in n] and not compiled8.notes


def test_float8_all_gather_sends_a_byte_a_weight_casts_the_shard_and_holds_less():
    """precision.float8_enable_fsdp_all_gather: the block's seven float8 linears travel a byte an
    element, after an amax all-reduce per weight (or one for them all a step, precomputed); their
    forward no longer casts the weight; the gathered block holds a byte less a weight."""
    from titan_exp.perf.memory import predict_memory
    from titan_exp.perf.shapes import float8_gathered

    short = ["training.seq_len=512", "training.local_batch_size=1", "training.global_batch_size=16",
             "parallelism.data_parallel_shard_degree=16", "cluster.nproc_per_node=8", "cluster.nnodes=2",
             "precision=float8", "compile.enable=true"]
    on = ["precision.float8_enable_fsdp_all_gather=true"]
    m = llama8b(*short).model
    linears = 2 * m.dim * (m.n_heads + m.kv_heads) * m.head_size + 3 * m.dim * m.ffn_hidden_dim
    assert float8_gathered(llama8b(*short, *on)) == (linears, 7)
    assert float8_gathered(llama8b(*short)) == (0, 0)
    ddp = ["parallelism.data_parallel_shard_degree=1", "parallelism.data_parallel_replicate_degree=16"]
    assert float8_gathered(llama8b(*short, *on, *ddp)) == (0, 0)  # no FSDP: no such gather
    two_nodes = spec_profile(H100, 16, 8)
    bf16, f8, pre = (predict_step(llama8b(*short, *o), two_nodes, cuda=True) for o in
                     ([], on, [*on, "precision.float8_precompute_dynamic_scale_for_fsdp=true"]))
    # half the bytes a gather, less seven amax all-reduces (tiny: NCCL's LL latency) or one a step
    assert pre.parts["fsdp"] < f8.parts["fsdp"] < bf16.parts["fsdp"]
    assert f8.parts["compute"] < bf16.parts["compute"]  # the weight's cast left the forward
    saved = (predict_memory(llama8b(*short), cuda=True)["fsdp_working_set"]
             - predict_memory(llama8b(*short, *on), cuda=True)["fsdp_working_set"]) * 2**30
    # the working set's peak: the embedding (128k vocabulary, not float8) at work and the next block, prefetched
    assert saved == pytest.approx(linears)


def test_fsdp_and_async_tp_hide_what_the_schedule_lets_them():
    assert overlap.fsdp_exposed(1.0, 0.5, 2, fwd_s=0.4, bwd_s=1.0, blocks=3, ends_s=0.1) == pytest.approx(
        0.1 + 1.0 + 2 * 0.6 + 3 * 0.5)
    assert overlap.fsdp_exposed(1.0, 0.5, 1, fwd_s=2.0, bwd_s=2.0, blocks=3, ends_s=0.0) == pytest.approx(1.0)
    # groups q/k/v, o, w1/w3, w2; all-gathers of 1.0 (forward 0.5: float8), reduce-scatters of 0.8
    groups = (0.7, 0.3, 2.0, 1.0)
    forward, backward = overlap.async_tp_exposed(0.5, 1.0, 0.8, groups, partials_s=0.05)
    assert forward == pytest.approx((0.8 - 0.3) + 2 * 0.05)  # rs outlasts o's GEMM; the partials' sums
    assert backward == pytest.approx((1.0 - 0.3) + 0.0 + 2 * 0.8)  # ag with o's, w2's GEMMs; summed rs unfused
    te = overlap.async_tp_exposed(0.5, 1.0, 0.8, groups, partials_s=0.05, overlap="userbuffers")
    assert te == pytest.approx((0.8 - 0.3, (1.0 - 0.7) + (0.8 - 0.3)))  # every collective beside a GEMM
    with pytest.raises(ValueError, match="overlap 'nccl'"):
        overlap.async_tp_exposed(0.5, 1.0, 0.8, groups, 0.05, overlap="nccl")
    tp = ["parallelism.data_parallel_shard_degree=4", "parallelism.tensor_parallel_degree=2", "training.local_batch_size=8"]
    plain = predict_step(llama8b(*tp), spec_profile(H100, 8, 8), cuda=True)
    fused = predict_step(llama8b(*tp, "parallelism.enable_async_tensor_parallel=true", "compile.enable=true"),
                         spec_profile(H100, 8, 8), cuda=True)
    assert 0 <= fused.parts["tp"] < 0.8 * plain.parts["tp"]
    engine = predict_step(llama8b(*tp, "parallelism.enable_async_tensor_parallel=true", "compile.enable=true"),
                          spec_profile(H100, 8, 8), cuda=True, tp_overlap="userbuffers")
    assert engine.parts["tp"] < fused.parts["tp"]  # torch's pass leaves the backward's summed gradients unfused


def test_pipeline_sends_wait_in_the_fill_and_drain_and_where_they_outlast_a_chunk():
    # 4 stages, 16 sends a round: hidden behind chunks of 2.0 s, only the fill's and drain's 2 x 3 wait
    assert overlap.p2p_exposed(0.5, 4, 16, chunk_fwd_s=2.0) == pytest.approx(2 * 3 * 0.5)
    assert overlap.p2p_exposed(0.5, 4, 16, chunk_fwd_s=0.2) == pytest.approx(2 * 3 * 0.5 + 16 * 0.3)
    pp = ["parallelism.data_parallel_shard_degree=2", "parallelism.pipeline_parallel_degree=4",
          "parallelism.pipeline_parallel_microbatch_size=1", "training.local_batch_size=8"]
    profile = spec_profile(H100, 8, 8)
    step = predict_step(llama8b(*pp), profile, cuda=True)
    send = profile.collective("send_recv", 2)(1 * 8192 * 4096 * 2)  # a microbatch's bf16 activations, NVLink
    assert step.parts["p2p"] == pytest.approx(2 * 3 * send)  # 8 microbatches' 16 sends hide behind 8 layers each
    assert step.parts["p2p"] < 16 * send  # what waiting on every send would cost


def test_collectives_inside_a_stages_blocks_lengthen_the_pipelines_fill_and_drain_too():
    """TP's collectives run inside every microbatch of a stage, so a microbatch reaches the next
    stage as late as they make it: the bubble is (pp - 1) / v of the slowest rank's microbatch
    with them, not of its compute alone (on a GPU priced from its parts)."""
    job = llama8b("parallelism.data_parallel_shard_degree=1", "parallelism.tensor_parallel_degree=2",
                  "parallelism.pipeline_parallel_degree=4", "parallelism.pipeline_parallel_microbatch_size=1",
                  "training.local_batch_size=8", "training.global_batch_size=8")
    parts = predict_step(job, spec_profile(H100, 8, 8), cuda=True).parts
    microbatch = (parts["compute"] + parts["recompute"] + parts["tp"]) / 8
    assert parts["tp"] > 0.02 * parts["compute"]
    assert parts["bubble"] == pytest.approx(3 * microbatch)


def test_a_pipeline_steps_at_its_slowest_ranks_pace_with_each_ranks_own_communication():
    """The critical path is the slowest rank's compute; each rank adds its own communication, and
    the step is the rank that ends last. OLMoE's 16 MoE blocks over PP 4 and EP 16 across two
    nodes, the last stage a block short: a middle rank has the most blocks and all-to-alls. Give
    the last stage three passes through the output head (a published model's multi-token
    prediction runs it more than once: output_heads) and it sets the pace, but the middle rank,
    waiting as long and exchanging a block's more tokens, still ends last. (Until 2026-11-28 the
    step took the communication of the rank with the most compute: adding work made it faster.)"""
    job = resolve(compose_job(["model=olmoe_1b_7b", "precision=bf16", "training.seq_len=4096",
                               "training.local_batch_size=8", "training.global_batch_size=32",
                               "parallelism.data_parallel_shard_degree=4", "parallelism.pipeline_parallel_degree=4",
                               "parallelism.pipeline_parallel_microbatch_size=1", "parallelism.expert_parallel_degree=4",
                               "parallelism.pipeline_parallel_last_stage_less_layers=1", "cluster.executor=slurm",
                               "cluster.nnodes=2", "cluster.nproc_per_node=8"]))
    profile = spec_profile(H100, 16, 8)
    once, twice, thrice = (predict_step(job, profile, cuda=True, output_heads=h) for h in (1, 2, 3))
    assert twice.step_s == pytest.approx(once.step_s)  # 3 blocks and 2 heads: still under a middle rank's 4 blocks
    assert thrice.parts["bubble"] > once.parts["bubble"] and thrice.step_s > once.step_s  # the last rank sets the pace
    assert thrice.parts["ep"] == pytest.approx(once.parts["ep"]) and thrice.parts["compute"] == pytest.approx(
        once.parts["compute"])  # and a middle rank's 4 blocks, their all-to-alls among them, end the step
    assert thrice.step_s - once.step_s == pytest.approx(thrice.parts["bubble"] - once.parts["bubble"])


def test_a_hardware_files_power_limit_lowers_the_prediction(tmp_path):
    (tmp_path / "hw.yaml").write_text("device: h100\npower_limit_w: 500\n")
    hw = load_hardware(tmp_path / "hw.yaml")
    assert hw.spec.power_limit_w == 500 and "SM clock 0.88 of the 700 W TDP's" in hw.line()
    capped = predict_step(llama8b(), spec_profile(hw.spec, 8, 8, hw.efficiency), cuda=True)
    full = predict_step(llama8b(), spec_profile(H100, 8, 8), cuda=True)
    assert 1.05 < capped.step_s / full.step_s < 1 / rates.clock_ratio(hw.spec) + 1e-9
    (tmp_path / "own.yaml").write_text("device: {bf16_tflops: 500, tf32_tflops: 250, memory_gib: 64, memory_tb_s: 2, "
                                       "tdp_w: 400, sms: 100}\nnvlink_gb_s: 200\nnetwork_gb_s: 25\npower_limit_w: 300\n")
    own = load_hardware(tmp_path / "own.yaml").spec
    assert (own.tdp_w, own.sms, own.power_limit_w) == (400, 100, 300) and rates.clock_ratio(own) < 1


def test_a_grace_hosted_gpu_pays_its_hosts_slower_python_where_the_host_bounds_a_block(tmp_path):
    """Host time per op by the host's CPU (perf.gpu's [host], [te-2053]): a GB200's or GB300's Grace
    runs the ranks' Python 37.08 / 13.48 times as long as an x86 host, a B200's. A block the GPU
    bounds keeps its time; one small enough for the host to bound slows by that ratio. A hardware
    file may say which CPU hosts its GPUs."""
    ratio = 37.08 / 13.48
    x86, grace = rates.spec_kernels(SPECS["b200"]), rates.spec_kernels(SPECS["gb200"])
    assert (x86.host_eager_s, x86.host_compiled_s) == (rates.HOST_EAGER_S, rates.HOST_COMPILED_S)
    assert grace.host_eager_s == pytest.approx(ratio * rates.HOST_EAGER_S)
    assert grace.host_compiled_s == pytest.approx(ratio * rates.HOST_COMPILED_S)
    on_grace = dataclasses.replace(x86, host_eager_s=grace.host_eager_s, host_compiled_s=grace.host_compiled_s)
    big, small = llama8b(), olmoe_job(8)  # 8,192 tokens of an 8B block; 1,024 of an MoE layer's
    assert gpu.block_times(big, 1, on_grace).fwd == gpu.block_times(big, 1, x86).fwd  # the GPU bounds it
    host = gpu.block_times(small, 1, x86).fwd
    assert host > sum(gpu.block_times(small, 1, x86).kinds["fwd"].values())  # the host bounds it
    assert gpu.block_times(small, 1, on_grace).fwd == pytest.approx(ratio * host)
    assert any(n.startswith("the host bounds a block") for n in gpu.block_times(small, 1, x86).notes)
    assert not any(n.startswith("the host bounds") for n in gpu.block_times(big, 1, on_grace).notes)
    (tmp_path / "hw.yaml").write_text("device: b200\nhost_cpu: grace\n")
    hw = load_hardware(tmp_path / "hw.yaml")
    assert hw.spec.host_cpu == "grace" and "host_cpu grace" in hw.line()
    assert rates.spec_kernels(hw.spec).host_eager_s == pytest.approx(grace.host_eager_s)


def test_a_calibrated_gpus_measured_kernels_drive_the_same_model():
    """Issue 36, part 5: a profile calibrated on a GPU keeps its kernels' measured rates, and a
    block it has not measured is priced from its parts at those rates, as a spec sheet's is."""
    spec = spec_profile(H100, 8, 8, attention="flash")  # K100's kernel
    measured = dataclasses.replace(K100, source="calibrated", measured=("matmul_tflops",))
    assert Kernels.of(json.loads(json.dumps(measured.to_dict()))) == measured  # as the profile's file keeps it
    calibrated = MachineProfile.from_dict({**spec.to_dict(), "source": "calibrated", "kernels": measured.to_dict()})
    same = predict_step(llama8b(), calibrated, cuda=True).step_s
    assert same == pytest.approx(predict_step(llama8b(), spec, cuda=True).step_s)
    slow_gemms = dataclasses.replace(measured, matmul_tflops={d: r / 2 for d, r in K100.matmul_tflops.items()})
    slower = predict_step(llama8b(), dataclasses.replace(calibrated, kernels=slow_gemms), cuda=True)
    assert 1.3 < slower.step_s / same < 2.0  # the GEMMs are most of an 8B block, not all of it
    slow_attention = dataclasses.replace(measured, attention_fwd=tuple((s, r / 2) for s, r in K100.attention_fwd))
    assert same < predict_step(llama8b(), dataclasses.replace(calibrated, kernels=slow_attention), cuda=True).step_s
    # A CPU's kernels are recorded, not priced from: its plan reads its measured blocks.
    cpu = dataclasses.replace(calibrated, kernels=dataclasses.replace(measured, architecture="cpu"))
    assert any("not calibrated: estimated from FLOPs" in n for n in predict_step(llama8b(), cpu, cuda=True).notes)


def test_the_blocks_memory_bound_kernels_run_at_the_rate_calibration_measured_for_them():
    """A profile whose calibration measured the block's own memory-bound ops (Kernels.
    elementwise_tb_s) prices the model's memory-bound kernels at that rate, eager or compiled as the
    job runs, and nothing else: at half the add's rate eager, an eager block's memory-bound work
    takes twice as long, its GEMMs and attention as before, and a compiled job, with no compiled
    rate measured, keeps the add's; a profile without the rate, as calibrated before 2026-11-28,
    prices them at the add's rate as a spec sheet does."""
    from titan_exp.perf.gpu import block_times

    half = dataclasses.replace(K100, elementwise_tb_s={"eager": K100.memory_tb_s / 2})
    assert Kernels.of(json.loads(json.dumps(half.to_dict()))) == half  # as the profile's file keeps it
    assert Kernels.of({k: v for k, v in K100.to_dict().items() if k != "elementwise_tb_s"}) == K100
    for compiled in (False, True):
        job = llama8b(f"compile.enable={str(compiled).lower()}")
        plain, slow = (block_times(job, 1, k).kinds for k in (K100, half))
        for part in ("fwd", "bwd", "head"):
            assert slow[part]["gemm"] == plain[part]["gemm"] and slow[part]["attention"] == plain[part]["attention"]
            assert slow[part]["memory_bound"] == pytest.approx(plain[part]["memory_bound"] * (1 if compiled else 2))


def test_a_spec_sheets_collectives_take_nccls_latencies_and_its_fastest_protocol():
    """perf.nccl: NCCL's tuner's latencies, base + steps x a step's, Simple's for large messages;
    small ones take LL (a quarter of the bandwidth), an all-reduce across nodes a tree. An 8-GPU
    all-reduce of 4 bytes costs LL's 15 us, where 2 x 7 steps of 10 us once priced it at 140 us."""
    inside, across = spec_profile(H100, 8, 8), spec_profile(H100, 16, 8)
    ar = inside.collective("all_reduce", 8)
    assert ar.latency_s == pytest.approx(8.4e-6 + 14 * 3.4e-6)  # Simple's ring: what a large message pays
    assert ar(4) == pytest.approx(6.6e-6 + 14 * 0.6e-6, rel=1e-3)  # LL's ring
    assert ar(1e9) == pytest.approx(ar.latency_s + 1e9 * ar.per_unit_s)  # Simple's, at the links' bandwidth
    tree = across.collective("all_reduce", 16, True, 8)  # 2 nodes of 8: LL's tree, 2 (7 x 0.6 + 1 x 5) us
    assert tree(4) == pytest.approx(6.8e-6 + 2 * (7 * 0.6e-6 + 5e-6), rel=1e-3)
    gather = inside.collective("all_gather", 8)
    assert gather(1 << 20) < gather.latency_s + (1 << 20) * gather.per_unit_s  # 1 MiB: LL128's, not Simple's
    a2a = across.collective("all_to_all", 16, True, 8)  # a step a peer: 7 inside the node, 8 on the other
    assert a2a.latency_s == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 8 * 14e-6)
    assert a2a(8 * 128) == pytest.approx(6.6e-6 + 7 * 0.6e-6 + 8 * 2.7e-6, rel=1e-2)  # EP's counts: LL's steps
    assert inside.collective("send_recv", 2).latency_s == pytest.approx(8.4e-6 + 3.4e-6)


def test_a_group_spanning_nodes_sends_through_each_of_its_gpus_nics():
    """NCCL's rings leave a node through the NIC of each GPU the group has there: FSDP over 2 full
    nodes moves its bytes 8 x faster than through one NIC (but no faster than NVLink); HSDP's
    replicas, one rank per node, through one."""
    two_nodes = ["cluster.nnodes=2", "cluster.nproc_per_node=8"]
    fsdp16 = llama8b(*two_nodes, "parallelism.data_parallel_shard_degree=16", "training.global_batch_size=32")
    hsdp = llama8b(*two_nodes, "parallelism.data_parallel_shard_degree=8", "parallelism.data_parallel_replicate_degree=2",
                   "training.global_batch_size=32")
    tp2 = llama8b(*two_nodes, "parallelism.data_parallel_shard_degree=8", "parallelism.tensor_parallel_degree=2",
                  "training.global_batch_size=16")
    assert (node_ranks(fsdp16, ("dp_shard", "cp")), node_ranks(hsdp, ("dp_replicate",)), node_ranks(hsdp, ("dp_shard", "cp")),
            node_ranks(tp2, ("dp_shard", "cp")), node_ranks(tp2, ("tp",))) == (8, 1, 8, 4, 2)
    profile = spec_profile(H100, 16, 8)
    one_nic = profile.collective("all_gather", 16, True)
    eight = profile.collective("all_gather", 16, True, 8)
    nvlink = profile.collective("all_gather", 16).per_unit_s
    assert eight.per_unit_s == pytest.approx(max(one_nic.per_unit_s / 8, nvlink))
    assert eight.per_unit_s < one_nic.per_unit_s / 7
    # NCCL's ring latency (perf.nccl): 1 of 15 steps between the 2 nodes, against all 15 one to a node
    assert (eight.latency_s, one_nic.latency_s) == pytest.approx((8.4e-6 + 14 * 3.4e-6 + 14e-6, 8.4e-6 + 15 * 14e-6))
    # An all-to-all of 16 ranks over 2 nodes sends half of each rank's bytes off its node, through
    # its own NIC, as 2 ranks one to a node do (priced once as 16 nodes' 15/16: 1.9 x too slow).
    a2a = profile.collective("all_to_all", 16, True, 8)
    assert a2a.per_unit_s == pytest.approx(profile.collective("all_to_all", 2, True).per_unit_s)
    assert a2a.per_unit_s < profile.collective("all_to_all", 16, True).per_unit_s / 1.8
    inside = predict_step(llama8b(), spec_profile(H100, 8, 8), cuda=True)
    across = predict_step(fsdp16, profile, cuda=True)
    assert across.parts["fsdp"] < 0.05 * across.step_s and across.tokens_per_s_per_device > 0.95 * inside.tokens_per_s_per_device


def test_hsdp_all_reduces_each_blocks_gradient_beside_the_backward():
    """FSDP2 all-reduces a block's gradient shard over the replicas right after its reduce-scatter,
    beside the backward of the blocks before it: of the 8B's HSDP over two nodes only the
    embedding's and the output's all-reduces wait (until 2026-11-28 every unit's did)."""
    hsdp = llama8b("cluster.nnodes=2", "cluster.nproc_per_node=8", "parallelism.data_parallel_shard_degree=8",
                   "parallelism.data_parallel_replicate_degree=2", "training.global_batch_size=32")
    profile = spec_profile(H100, 16, 8)
    ar = profile.collective("all_reduce", 2, True, 1)  # one replica per node: each through its own NIC
    m = hsdp.model
    ends = ar(m.embedding_params / 8 * 4) + ar(m.output_params / 8 * 4)
    blocks = m.n_layers * ar(m.block_params / 8 * 4)
    assert predict_step(hsdp, profile, cuda=True).parts["hsdp"] == pytest.approx(ends) and blocks > 5 * ends


def test_expert_parallel_stays_in_a_node_however_far_data_parallel_reaches():
    """EP's group is dp_shard's innermost ranks (parallel/dims.py): EP 8 over two nodes of 8 keeps
    its all-to-alls on NVLink, as on one node; EP 16 sends them over the network. (They were once
    priced over the network whenever dp_shard spanned nodes: Megatron-Bridge's GPT-OSS 120B rows,
    EP 8 on 64 B200s, predicted 64 % too slow.)"""
    def olmoe(gpus: int, ep: int):
        return resolve(compose_job(["model=olmoe_1b_7b", "precision=bf16", "training.seq_len=4096",
                                    "training.local_batch_size=2", f"training.global_batch_size={2 * gpus}",
                                    f"parallelism.data_parallel_shard_degree={gpus}",
                                    f"parallelism.expert_parallel_degree={ep}", "cluster.executor=slurm",
                                    f"cluster.nnodes={gpus // 8}", "cluster.nproc_per_node=8"]))
    one_node = predict_step(olmoe(8, 8), spec_profile(H100, 8, 8), cuda=True).parts["ep"]
    two_nodes = spec_profile(H100, 16, 8)
    assert predict_step(olmoe(16, 8), two_nodes, cuda=True).parts["ep"] == pytest.approx(one_node)
    assert predict_step(olmoe(16, 16), two_nodes, cuda=True).parts["ep"] > 3 * one_node
    # the plan's "across nodes" column names EP's group where it leaves its node
    assert across_nodes(olmoe(16, 8)) == {"dp_shard"} and across_nodes(olmoe(16, 16)) == {"dp_shard", "ep"}


def test_an_engine_that_pairs_microbatches_hides_eps_all_to_alls_behind_the_other_ones_compute():
    """perf.overlap.ep_exposed (Megatron-Core's overlap_moe_expert_parallel_comm): a forward's
    all-to-alls beside the paired backward's compute, a backward's beside the forward's; the first
    forward and the last backward wait in full. This toolkit's EP, unpaired, waits in full."""
    # 4 microbatches: 0.3 s of forward all-to-alls behind 2.0 s of backward hide; 0.3 s of
    # backward ones behind a 0.1 s forward leave 0.2; the unpaired ends wait 0.3 + 0.3
    assert overlap.ep_exposed(0.3, 0.3, 0.1, 2.0, 4) == pytest.approx((3 * 0.2 + 0.6) / 4)
    assert overlap.ep_exposed(0.3, 0.3, 1.0, 2.0, 1) == pytest.approx(0.6)  # one microbatch: nothing to pair
    with pytest.raises(ValueError, match="microbatches = 0"):
        overlap.ep_exposed(0.3, 0.3, 1.0, 2.0, 0)
    job = olmoe_job(8, "training.global_batch_size=64")  # 8 microbatches a rank
    profile = spec_profile(H100, 8, 8)
    alone, paired = (predict_step(job, profile, cuda=True, ep_overlap=o) for o in (False, True))
    # OLMoE's blocks outlast their all-to-alls on NVLink: only the unpaired ends' wait, 1/8 of them
    assert paired.parts["ep"] == pytest.approx(alone.parts["ep"] / 8)
    assert paired.step_s == pytest.approx(alone.step_s - 7 / 8 * alone.parts["ep"], rel=1e-6)
    # a block not priced from a GPU's parts (a CPU's, gloo's) pairs nothing
    assert (predict_step(job, profile, cuda=False, ep_overlap=True).parts["ep"]
            == predict_step(job, profile, cuda=False).parts["ep"])


def olmoe_job(ep: int, *overrides: str):
    return resolve(compose_job(["model=olmoe_1b_7b", "precision=bf16", "training.seq_len=1024",
                                "training.local_batch_size=1", "training.global_batch_size=8",
                                "parallelism.data_parallel_shard_degree=8",
                                f"parallelism.expert_parallel_degree={ep}", "cluster.nproc_per_node=8", *overrides]))


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

    def extra(ep, *more, full=0):
        return moe_tp_extra(olmoe_job(ep, "parallelism.tensor_parallel_degree=2", *more), rs, ar, act_elements, act, full)
    assert extra(1) == pytest.approx(rs(act) + weights)  # all-reduced where reduce-scattered
    assert extra(1, "model.n_shared_experts=1") == pytest.approx(5 * rs(act) + weights)
    assert extra(8) == pytest.approx(-2 * rs(act) + weights)
    assert extra(8, full=1) == pytest.approx(-3 * rs(act) + weights)  # the recomputed forward's too
    assert extra(8, "model.n_shared_experts=1") == pytest.approx(4 * rs(act) + weights)
    assert moe_tp_extra(resolve(compose_job(["model=llama3_8b"])), rs, ar, act_elements, act, 0) == 0.0


def test_an_moes_routed_experts_are_one_grouped_gemm_over_the_local_experts():
    """OLMoE (64 experts of 2048 x 1024, 8 a token), 1,024 tokens a rank: 8,192 routed rows. At EP 1
    each expert gets 128 rows and the grouped GEMM reads all 64 experts' weights, so it is bound by
    its bytes; EP 8 leaves 8 experts of 1,024 rows, bound by their FLOPs. (The experts were once
    priced as top_k dense GEMMs of the token rows, the same at every EP degree.) Under float8 this
    toolkit's routed experts stay in bf16; an engine whose grouped linears take the recipe pays
    float8's rate and its casts."""
    one, eight = (gpu.block_times(olmoe_job(ep), 1, K100) for ep in (1, 8))
    w1_w3 = 64 * 2 * ((128 * 2048 + 2048 * 1024) * 2 + 128 * 1024 * 2) / gpu.hbm(K100)
    assert one.tp_groups[2] == pytest.approx(w1_w3)  # no shared experts: the group is the routed w1 and w3
    assert one.tp_groups[2] > 2 * eight.tp_groups[2]
    flops = 2 * 2 * 8192 * 1024 * 2048  # w1 and w3, 8 experts in 512 tiles: 4 waves of 132 SMs
    assert eight.tp_groups[2] == pytest.approx(flops / (K100.matmul_tflops["bfloat16"] * 1e12 * 512 / 528))
    gpu_s = lambda t, phase: sum(t.kinds[phase].values())  # noqa: E731  (at 1,024 tokens the host bounds both)
    assert gpu_s(one, "fwd") > gpu_s(eight, "fwd") and gpu_s(one, "bwd") > gpu_s(eight, "bwd")
    half = gpu.block_times(olmoe_job(8), 1, dataclasses.replace(K100, grouped_gemm_share=0.5))  # as calibrated
    assert half.tp_groups[2] == pytest.approx(2 * eight.tp_groups[2]) and half.tp_groups[0] == eight.tp_groups[0]
    float8 = olmoe_job(8, "precision=float8", "compile.enable=true")
    ours, engines = gpu.block_times(float8, 1, K100), gpu.block_times(float8, 1, K100, float8_experts=True)
    assert ours.tp_groups[2] == pytest.approx(eight.tp_groups[2])
    assert engines.tp_groups[2] < 0.6 * ours.tp_groups[2]  # float8 at its share of twice the peak [mamf]
    # the step prices the engine it is given (at 1,024 tokens a rank float8's casts outweigh its GEMMs,
    # and on a host that kept up with the GPU: as priced, the host bounds both)
    quick_host = dataclasses.replace(K100, host_eager_s=0.0, host_compiled_s=0.0)
    h100 = dataclasses.replace(spec_profile(H100, 8, 8), kernels=quick_host)
    assert predict_step(float8, h100, cuda=True, float8_experts=True).step_s != predict_step(float8, h100, cuda=True).step_s


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
    dispatch = 2048 * (rows * per_row + toks * per_token) / gpu.hbm(K100)
    gpu_only = dataclasses.replace(K100, host_eager_s=0.0)  # at 1,024 tokens a rank its host would bound it
    assert gpu.block_times(ep8, 1, gpu_only).fwd - gpu.block_times(ep8, 1, gpu_only, plain).fwd == pytest.approx(dispatch)
    with_ep, without = (gpu.routed_experts(job, toks, K100, "bfloat16", "bfloat16", None, "torchao", model_ops.LLAMA)
                        for job in (ep8, olmoe_job(1)))
    assert with_ep.dispatch_bytes - without.dispatch_bytes == 2048 * rows * model_ops.EP_SORT_BYTES  # sorted and back
