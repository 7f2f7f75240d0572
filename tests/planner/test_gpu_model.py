"""The GPU model from its parts (titan_exp/perf/model/block.py, issue 36): each part moves a prediction
by what it physically changes: GEMMs, attention, memory-bound kernels, the host, clocks and what
calibration measures of them. Float8, communication and MoE layers: test_gpu_model_{float8,comm,moe}.py.
Arithmetic only (seconds to run)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from gpu_model_jobs import H100, K100, llama8b, olmoe_job

from titan_exp.config import compose_job
from titan_exp.perf.model import block as gpu
from titan_exp.perf.model.block import elementwise_bytes
from titan_exp.perf.model.engine import Engine
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates import kernels as rates
from titan_exp.perf.rates import model_ops
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.hardware import load_hardware
from titan_exp.perf.rates.kernels import hbm
from titan_exp.perf.rates.profile import Kernels, MachineProfile
from titan_exp.validation import resolve

pytestmark = pytest.mark.quick
QWEN3_SHAPE = ["model.head_dim=32", "model.qk_norm=true"]  # Qwen3-like: 16 heads of 32 (twice dim), QK-norm


def test_a_gemm_pays_for_its_last_wave_and_a_skinny_one_for_its_bytes():
    full = 132 * gpu.TILE  # one tile row per SM: one full wave
    assert gpu.wave_utilization(gpu.TILE, full, 132) == pytest.approx(1.0)
    assert (gpu.wave_utilization(gpu.TILE, full + 1, 132)
            == pytest.approx((full + 1) / (2 * full)))  # a second, near-empty wave
    per_flop = lambda n: gpu.gemm_s(K100, 12 * gpu.TILE, n, 8192, "bfloat16") / n  # noqa: E731
    assert per_flop(12 * gpu.TILE) > 1.8 * per_flop(11 * gpu.TILE)  # 144 tiles: two waves; 132: one
    skinny = gpu.gemm_s(K100, 8192, 8192, 16, "bfloat16")  # K = 16: reads and writes dominate
    assert skinny == pytest.approx((8192 * 16 * 2 + 16 * 8192 * 2 + 8192 * 8192 * 2) / hbm(K100))
    # float8 at its own measured share of twice the peak [mamf]: 70.9 % against bf16's 80.3 % on an H100
    f8, bf = (gpu.gemm_s(K100, 8192, 8192, 8192, dtype) for dtype in ("float8", "bfloat16"))
    assert f8 == pytest.approx(bf * (794.5 / 989) / (2 * 1402.6 / 1979), rel=1e-3) and 0.55 * bf < f8 < 0.6 * bf


def test_a_power_cap_slows_the_clock_not_the_memory():
    capped = SPECS["h100_500w"]
    ratio = ((500 - 70) / (700 - 70)) ** (1 / 3)
    assert rates.clock_ratio(capped) == pytest.approx(ratio) and rates.clock_ratio(H100) == 1.0
    same_hbm = rates.spec_kernels(dataclasses.replace(capped, memory_tb_s=H100.memory_tb_s))
    assert same_hbm.matmul_tflops["bfloat16"] == pytest.approx(ratio * K100.matmul_tflops["bfloat16"])
    assert hbm(same_hbm) == hbm(K100)
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
        return sum(getattr(gpu.block_times(job, 1, kern), k) - getattr(gpu.block_times(job, 1, free), k)
                   for k in ("fwd", "bwd"))

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
    compiled = gpu.block_times(dataclasses.replace(tiny, compile=dataclasses.replace(tiny.compile, enable=True)),
                               1, K100)
    assert compiled.fwd == pytest.approx(model_ops.LLAMA.compiled_kernels * rates.HOST_COMPILED_S)
    eager, fused = gpu.block_times(llama8b(), 1, K100), gpu.block_times(llama8b("compile.enable=true"), 1, K100)
    assert (sum(eager.tp_groups) == sum(fused.tp_groups)
            and 1.1 < (eager.fwd + eager.bwd) / (fused.fwd + fused.bwd) < 1.5)


def test_a_blocks_memory_bound_kernels_are_priced_as_its_model_runs_them():
    """perf.rates.model_ops.Elementwise: the bytes per token a block's norms, adds, RoPE and activation move,
    and the loss's per logit, at HBM speed; Llama's by default, another model's when given."""
    job = llama8b()
    none = model_ops.Elementwise((0, 0, 0), (0, 0, 0), model_ops.LLAMA.eager_ops, model_ops.LLAMA.compiled_kernels,
                                 0, 0)
    llama, free = gpu.block_times(job, 1, K100), gpu.block_times(job, 1, K100, Engine(elementwise=none))
    tokens, d, qk, f = 2 * 8192, 4096, (32 + 8) * 128, 14336
    repeat_kv = tokens * 2 * (8 + 32) * 128 * 2  # GQA's K and V copied to every head: not the model's table
    moved = tokens * (model_ops.LLAMA.eager_bytes[0] * d + model_ops.LLAMA.eager_bytes[1] * qk
                      + model_ops.LLAMA.eager_bytes[2] * f)
    assert llama.fwd - free.fwd == pytest.approx(moved / hbm(K100))
    assert llama.bwd - free.bwd == pytest.approx(2 * moved / hbm(K100))
    assert free.fwd - sum(free.tp_groups) > repeat_kv / hbm(K100)  # attention and the copy remain
    assert llama.head - free.head == pytest.approx(tokens * 128256 * model_ops.LLAMA.loss_bytes_eager / hbm(K100))
    assert predict_step(job, spec_profile(H100, 8, 8), cuda=True, engine=Engine(elementwise=none)).step_s < \
        predict_step(job, spec_profile(H100, 8, 8), cuda=True).step_s  # the step prices the block it is given


@pytest.mark.parametrize("overrides", [[], QWEN3_SHAPE], ids=["llama", "qwen3"])
def test_llamas_eager_bytes_and_ops_are_what_this_toolkits_block_runs(overrides):
    """perf.rates.model_ops.LLAMA counted on titan_exp's own block in bf16 (block_bytes): every aten op
    of its forward but the matmuls and attention, by the bytes it reads and writes (an expanded
    input once), the norms as the fused kernel a CUDA torch runs them with (on CPU they run as
    separate ops); and its kernels, the matmuls' and attention's among them. With Qwen3's heads
    (twice dim wide together) and QK-norm, its qk_norm_bytes and qk_norm_ops besides."""
    m = compose_job(["model=debugmodel", *overrides]).model
    counted = block_bytes(overrides, autocast=False)
    qk = (m.n_heads + m.kv_heads) * m.head_size
    repeat_kv = 2 * (m.kv_heads + m.n_heads) * m.head_size * 2  # GQA's K and V copied to every head (block_times)
    eager, qk_norm = model_ops.LLAMA.eager_bytes, m.qk_norm * model_ops.LLAMA.qk_norm_bytes[0] * qk
    assert counted["fwd"] == eager[0] * m.dim + eager[1] * qk + eager[2] * m.ffn_hidden_dim + repeat_kv + qk_norm
    assert counted["fwd"] == elementwise_bytes(m, 1, model_ops.LLAMA, False, 1, 2, m.ffn_hidden_dim)  # as priced
    assert counted["kernels"] == model_ops.LLAMA.eager_ops + m.qk_norm * model_ops.LLAMA.qk_norm_ops[0]


def test_mlas_eager_bytes_and_ops_are_what_its_block_runs():
    """perf.rates.model_ops' MLA terms (mla_eager, mla_ops) counted the same way on the tiny DeepSeek-V3's
    dense block, its latents' norms as fused kernels, at shapes that move each term apart (heads,
    rotated width, latents; with and without the query latent); value heads as wide as query/key
    heads, where CPU's SDPA runs its flash kernel (narrower ones take its math path, whose ops are
    not a GPU's)."""
    from titan_exp.perf.model.block import latent_bytes

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
            weight = name == "_to_copy" and (ins[0].untyped_storage().data_ptr() in owned
                                             or tuple(outs[0].shape) in shapes)
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


@pytest.mark.parametrize("overrides", [[], QWEN3_SHAPE], ids=["llama", "qwen3"])
def test_calibration_times_the_blocks_own_memory_bound_ops_against_the_bytes_priced(overrides):
    """measure_kernels.elementwise_block runs the memory-bound ops of this toolkit's block and moves
    what the block does, counted the same way on both (debugmodel in bf16): the same forward
    kernels but the block's seven matmuls and its attention, the same bytes a token forward
    (perf.rates.model_ops.LLAMA's, with GQA's repeat), backward within 2 % (1 % more: one copy the
    block's backward does not make). So the rate calibration divides those bytes by
    (elementwise_tb_s, positive here on one gloo rank) is the rate of the bytes block_times prices."""
    import torch
    import torch.distributed as dist

    from titan_exp.perf.calibration import kernels as mk
    from titan_exp.perf.calibration.timing import Options

    m, seq = compose_job(["model=debugmodel", *overrides]).model, 48
    part = mk.elementwise_block(m, seq, torch.bfloat16, torch.device("cpu"))
    ops = moved_bytes(part.forward, part.norms, [p for n in part.norms for p in n.parameters()], part.tables, seq)
    whole = block_bytes(overrides, autocast=False, seq=seq)
    assert ops["kernels"] + 8 == whole["kernels"]
    assert ops["fwd"] == whole["fwd"] and ops["bwd"] == pytest.approx(whole["bwd"], rel=0.02)
    assert ops["fwd"] == elementwise_bytes(m, 1, model_ops.LLAMA, False, 1, 2, m.ffn_hidden_dim)
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

    from titan_exp.perf.calibration import timing

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

    from titan_exp.perf.calibration import kernels as mk
    from titan_exp.perf.model.block import latent_bytes, memory_bound_bytes

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
        assert (0.99 * cast_fwd < autocast["weights_fwd"] <= cast_fwd
                and 0.99 * cast_bwd < autocast["weights_bwd"] <= cast_bwd)


def test_a_single_gpus_step_pays_for_autocasts_casts():
    """perf.model.block prices autocast's work where a replica runs under it (perf.model.memory_gpu.autocast_replica)
    and nowhere else: eager, its rows' bytes and its weights' casts; compiled, its weights' casts
    alone (Inductor fuses the rest: not counted); a float8 block's weights no cast to bf16 forward
    (torchao casts them from fp32), their gradients' all the same; the output layer, bf16 under
    either, both; under FSDP, which casts the parameters, none."""
    job = llama8b("training.local_batch_size=1", "training.global_batch_size=1",
                  "parallelism.data_parallel_shard_degree=1", "cluster.nproc_per_node=1")
    sharded = llama8b()
    k, rate = K100, hbm(K100)
    tokens, dim, weights = 8192, 4096, job.model.block_matmul_params(1)
    rows = dict(zip(("fwd", "bwd"), model_ops.LLAMA.autocast_bytes))
    cast = dict(zip(("fwd", "bwd"), model_ops.LLAMA.autocast_weight_bytes))
    none = dataclasses.replace(model_ops.LLAMA, autocast_bytes=(0, 0), autocast_weight_bytes=(0, 0))
    for precision, compiled in itertools.product(("bf16", "float8"), (False, True)):
        on = llama8b_like(dataclasses.replace(job, precision=compose_job([f"precision={precision}"]).precision),
                          compiled)
        priced, bare = gpu.block_times(on, 1, k), gpu.block_times(on, 1, k, Engine(elementwise=none))
        for phase in ("fwd", "bwd"):
            cast_weights = 0 if (precision, phase) == ("float8", "fwd") else weights
            extra = (0 if compiled else tokens * dim * rows[phase]) + cast_weights * cast[phase]
            assert (priced.kinds[phase]["memory_bound"] - bare.kinds[phase]["memory_bound"]
                    == pytest.approx(extra / rate))
        assert priced.head - bare.head == pytest.approx(128256 * dim * (cast["fwd"] + cast["bwd"]) / rate)
    off = llama8b_like(sharded, False)
    assert gpu.block_times(off, 1, k).kinds == gpu.block_times(off, 1, k, Engine(elementwise=none)).kinds


def llama8b_like(job, compiled: bool):
    return dataclasses.replace(job, compile=dataclasses.replace(job.compile, enable=compiled))


def test_calibration_times_the_optimizer_phase_on_the_models_own_tensors(monkeypatch):
    """On a GPU, calibration times the optimizer phase as a step runs it (measure_compute.
    optimizer_phase: gradient norm, clipping and AdamW over the model's own tensors, in its order,
    up to `room` parameters), not AdamW over square matrices; on CPU here, one gloo rank."""
    import torch
    import torch.distributed as dist

    from titan_exp.models.llama import Transformer
    from titan_exp.perf.calibration.compute import optimizer_phase
    from titan_exp.perf.calibration.timing import Options

    m = compose_job(["model=debugmodel"]).model
    with torch.device("meta"):
        shapes = [tuple(p.shape) for p in Transformer(m).parameters()]
    stepped, norms, adamw = [], [], torch.optim.AdamW

    class Recording(adamw):
        def step(self, closure=None):
            stepped.append([tuple(p.shape) for g in self.param_groups for p in g["params"]])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    monkeypatch.setattr(torch.nn.utils, "get_total_norm",
                        lambda grads, **kw: norms.append(len(grads)) or torch.ones(()))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        whole = optimizer_phase(m, Options(tiny=True), torch.device("cpu"), room=10**12)
        assert whole > 0 and stepped[-1] == shapes and norms[-1] == len(shapes)
        optimizer_phase(m, Options(tiny=True), torch.device("cpu"), room=1)  # one tensor at least
        assert stepped[-1] == shapes[:1]
    finally:
        dist.destroy_process_group()


def test_a_hardware_files_power_limit_lowers_the_prediction(tmp_path):
    (tmp_path / "hw.yaml").write_text("device: h100\npower_limit_w: 500\n")
    hw = load_hardware(tmp_path / "hw.yaml")
    assert hw.spec.power_limit_w == 500 and "SM clock 0.88 of the 700 W TDP's" in hw.line()
    capped = predict_step(llama8b(), spec_profile(hw.spec, 8, 8, hw.efficiency), cuda=True)
    full = predict_step(llama8b(), spec_profile(H100, 8, 8), cuda=True)
    assert 1.05 < capped.step_s / full.step_s < 1 / rates.clock_ratio(hw.spec) + 1e-9
    (tmp_path / "own.yaml").write_text("device: {bf16_tflops: 500, tf32_tflops: 250, memory_gib: 64, memory_tb_s: 2, "
                                       "tdp_w: 400, sms: 100}\nnvlink_gb_s: 200\nnetwork_gb_s: 25\n"
                                       "power_limit_w: 300\n")
    own = load_hardware(tmp_path / "own.yaml").spec
    assert (own.tdp_w, own.sms, own.power_limit_w) == (400, 100, 300) and rates.clock_ratio(own) < 1


def test_a_grace_hosted_gpu_pays_its_hosts_slower_python_where_the_host_bounds_a_block(tmp_path):
    """Host time per op by the host's CPU (perf.model.block's [host], [te-2053]): a GB200's or GB300's Grace
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
    from titan_exp.perf.model.block import block_times

    half = dataclasses.replace(K100, elementwise_tb_s={"eager": K100.memory_tb_s / 2})
    assert Kernels.of(json.loads(json.dumps(half.to_dict()))) == half  # as the profile's file keeps it
    assert Kernels.of({k: v for k, v in K100.to_dict().items() if k != "elementwise_tb_s"}) == K100
    for compiled in (False, True):
        job = llama8b(f"compile.enable={str(compiled).lower()}")
        plain, slow = (block_times(job, 1, k).kinds for k in (K100, half))
        for part in ("fwd", "bwd", "head"):
            assert slow[part]["gemm"] == plain[part]["gemm"] and slow[part]["attention"] == plain[part]["attention"]
            assert slow[part]["memory_bound"] == pytest.approx(plain[part]["memory_bound"] * (1 if compiled else 2))
