"""A GPU's training step from its parts (issue 36): what each kernel of a block costs on a GPU
you plan for from its spec sheet, so that a small model, a skinny matmul, a float8 recipe, a
power cap or a compiled block each move the prediction by what they physically change.

Per microbatch of T tokens on one rank (T = microbatch x seq_len / cp), for one block at TP
degree tp, forward and backward:

  GEMMs     q, k, v, o and the SwiGLU's three, by shape (M, N, K); backward, each one's input
            gradient (M, K, N) and weight gradient (K, N, M). A GEMM takes the longer of its
            FLOPs at the dtype's peak x the clock under the power limit x the share of the peak
            the best-shaped matmul reaches [mamf] x its wave quantization (tiles of TILE x TILE
            over the SMs, the last wave partly idle), and its bytes at HBM speed (a skinny GEMM
            is memory-bound).
  attention causal flash attention, its FLOPs at the rate its kernel reaches at that sequence length
            and head dim [fa3] (a Blackwell GPU's own measured curves [cudnn-fe]), forward, and
            backward at 2.5 x the forward's FLOPs. A spec sheet's plan takes the kernel to be the
            one PyTorch SDPA picks [sdpa]: cuDNN's on Hopper and Blackwell, FlashAttention-2 on
            Ampere; a calibrated profile measures and names the one SDPA runs. ATTENTION also holds
            cuDNN's fused attention (Transformer Engine's on Hopper) and the Triton FlashAttention
            of 2023 [fa2].
  memory    the memory-bound kernels (RMSNorm, RoPE, residual adds, SwiGLU, the layout copies
            attention needs), their bytes per token at HBM speed [hbm]: as eager PyTorch runs them
            (each op reads and writes its tensors), or as compile fuses them
            (each fused group reads its inputs and writes its outputs once). Backward moves
            twice the forward's bytes. What a model's kernels move is an Elementwise
            (perf.model_ops): LLAMA, this toolkit's, unless another model's is given (a published
            run of MPT, say).
  float8    torchao's casts: each linear's input, weight and output gradient scaled (an amax
            pass and a cast) and cast again transposed for the backward GEMMs (compiled,
            tensorwise: from the float8 copy; rowwise and MXFP8: from bf16 along the other axis;
            eager, every recipe: from bf16, as separate kernels [torchao-eager]); the GEMMs at the
            FP8 peak (rowwise_with_gw_hp: the weight gradient's at bf16, its operands not cast).
  host      each op's Python and dispatch time (eager) or each compiled kernel's launch: a block
            takes the longer of its GPU time and its host time, so a small model is not
            predicted at peak. An eager float8 linear adds its cast kernels and torchao's Python
            around them (its tensor subclass and autograd functions) [torchao-eager]; an MoE
            layer its router's, dispatch's and exchange's ops (perf.model_ops counts them).
  head      the output projection's three GEMMs and the cross-entropy's bytes per logit (fp32
            upcast, log-softmax and its gradient; fused when compiled).
  MoE       an MoE layer's router (an fp32 GEMM), its routed experts as one grouped GEMM over the
            rank's n_experts / ep local experts (routed_experts: each expert's rows, and every
            local expert's weights read), and the dispatch's copies of the routed rows at HBM
            speed, as this toolkit's MoE layer moves them (Elementwise's dispatch bytes).

What of the communication these blocks' compute hides follows from the schedule: perf.overlap
(FSDP's gathers and reduce-scatters, async TP's collectives, a pipeline's sends), which perf.step
applies to them.

The rates each part runs at are a profile.Kernels: a spec sheet's (perf.kernel_rates, where each
rate's source is), or the GPU's own, measured by `python -m titan_exp.perf.calibrate` on it
(perf.measure_kernels: the best-shaped GEMM by dtype, flash attention by sequence, memory-bound
kernels, host time per op and per compiled kernel, the grouped GEMM's share of the dense rate).
The same model prices a block from either.

Sources (checked 2026-11): the rates' ([mamf], [fa3], [cudnn-fe], [sdpa], [fa2], [hbm], [host],
[te-2053], [power]) are perf.kernel_rates'; and
  [torchao-eager] torchao's float8 casts without compile: perf.float8_casts.
  [grouped] A grouped GEMM (torch._grouped_mm; Transformer Engine's grouped linears) is taken to
         run its tiles at the dense GEMM's rate (an assumption: no microbenchmark of these kernels
         is read here); calibrate measures the share on the GPU (Kernels.grouped_gemm_share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titan_exp.config import JobConfig, ModelConfig
from titan_exp.perf.float8_casts import cast_bytes, cast_host_s, cast_rate, recipe_of, torchao_eager
from titan_exp.perf.kernel_rates import HOST_CPU, attention_tflops, head_dim_share
from titan_exp.perf.memory_gpu import autocast_replica
from titan_exp.perf.model_ops import EP_SORT_BYTES, LLAMA, Elementwise
from titan_exp.perf.profile import Kernels
from titan_exp.perf.shapes import (
    ROUTER, attention_on_rank, block_linears, float8_gathered, low_precision_linears, selective_recomputed)
from titan_exp.precision import converts

TILE = 128  # a GEMM's output tile, rows and columns (cuBLAS's common large-GEMM tile; an assumption)


def wave_utilization(m: float, n: float, sms: int, groups: float = 1) -> float:
    """The share of the SMs' tile slots a GEMM's output fills (or `groups` outputs of m x n, one
    grouped kernel's): tiles of TILE x TILE, in waves of one tile per SM, the last wave and the
    edge tiles partly idle."""
    tiles = groups * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / sms)
    return groups * m * n / (waves * sms * TILE * TILE)


def hbm(k: Kernels) -> float:
    """Bytes per second of a memory-bound kernel."""
    return k.memory_tb_s * 1e12


def gemm_s(k: Kernels, m: float, n: float, kk: float, dtype: str, groups: float | None = None) -> float:
    """One GEMM (m x kk) @ (kk x n), or `groups` of them in one grouped kernel (an MoE's local
    experts, m rows each, at the grouped kernel's share of the rate): compute at the wave
    utilization of all their tiles together, each group's edge tiles partly idle; or their bytes,
    every group's operands read once; the longer."""
    if m * n * kk == 0:
        return 0.0
    size = {"float32": 4, "bfloat16": 2}.get(dtype, 1)  # float8, float8_fast, float8_rowwise: a byte
    g, rate = groups or 1, k.matmul_tflops[dtype] * (k.grouped_gemm_share if groups else 1.0)
    compute = 2 * g * m * n * kk / (rate * 1e12 * wave_utilization(m, n, k.sms, g))
    return max(compute, g * ((m * kk + kk * n) * size + m * n * 2) / hbm(k))


@dataclass
class BlockTimes:
    """Seconds per microbatch on one GPU: a block's forward and backward, the GEMM groups async TP
    fuses collectives with (forward; backward's input-gradient GEMMs are the same shapes), and the
    model's head (output projection and loss, forward and backward)."""

    fwd: float
    bwd: float
    selective_s: float  # what per-op selective AC recomputes: all but attention and every other GEMM
    tp_groups: tuple[float, float, float, float]  # q/k/v, o, w1/w3, w2 GEMMs, forward
    head: float
    notes: list[str]
    # The GPU's work in the same seconds by kind of kernel (perf.trace.KINDS: gemm, attention,
    # memory_bound), as a trace splits a step: a block's forward, its backward, what selective AC
    # recomputes, the head. The host's time, where it is longer, is not among them.
    kinds: dict[str, dict[str, float]] = field(default_factory=dict)


def block_times(job: JobConfig, tp: int, kern: Kernels, elementwise: Elementwise = LLAMA,
                float8_experts: bool = False) -> BlockTimes:
    """One block's and the head's seconds per microbatch, the memory-bound kernels as `elementwise`
    describes them (this toolkit's Llama unless said). An MoE's routed experts run in bf16 under a
    float8 recipe, as this toolkit's do (precision.apply_converter leaves them), unless
    `float8_experts` (Transformer Engine's grouped linears take the recipe)."""
    m, t, p = job.model, job.training, job.parallelism
    mb = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else t.local_batch_size
    cp = p.context_parallel_degree
    tokens = mb * t.seq_len / cp
    pr = job.precision
    high = "bfloat16" if pr.param_dtype == "bfloat16" or pr.full_bf16 else "float32"
    low = "float8" if pr.converter != "none" and "float8" in kern.matmul_tflops else high
    notes = [f"this GPU has no FP8 tensor cores: float8 at {high}"] if pr.converter != "none" and low != "float8" else []
    compiled = job.compile.enable
    cast_mode = "compiled" if compiled else elementwise.float8_casts
    act = 2 if high == "bfloat16" else 4

    # Linear layers (in, out) on one TP rank: the SwiGLU's width averaged over the blocks (dense
    # blocks' and MoE blocks' shared experts); an MoE layer's routed experts follow (routed_experts).
    # The attention's: q, k, v (MLA's projections to and from its latents) and o (perf.shapes).
    heads = m.n_heads // tp
    moe = m.n_moe_layers / m.n_layers
    ffn = (1 - moe) * m.ffn_hidden_dim / tp + moe * m.n_shared_experts * m.expert_hidden_dim / tp
    up, down = (m.dim, ffn), (ffn, m.dim)
    attention = attention_on_rank(m, tp)
    groups = [{name: shape for name, shape in attention.items() if name != "attention.wo"},
              {"attention.wo": attention["attention.wo"]}, {"feed_forward.w1": up, "feed_forward.w3": up},
              {"feed_forward.w2": down}]
    converted = low_precision_linears(job) if low != high else frozenset()  # the rest run in `high`
    names = block_linears(m)
    if low != high and len(converted) < len(names):
        kept = ", ".join(name for name in names if name not in converted)
        notes.append(f"{pr.converter}: {kept} stay in {high} (precision.filter_fqns {list(pr.filter_fqns)}), priced so")
    recipe = recipe_of(job)
    fwd_groups, fwd_gemms, bwd_gemm, casts = [], {}, 0.0, 0.0
    gathered8 = float8_gathered(job)[0] > 0  # FSDP gathers these weights cast already (priced with the gather)
    for group in groups:
        fwd_s = 0.0
        for name, (k, n) in group.items():
            dtype = low if name in converted else high
            fwd, bwd, cast = linear_s(kern, tokens, k, n, dtype, high, recipe, cast_mode, weight_cast=not gathered8)
            fwd_gemms[name] = fwd
            fwd_s, bwd_gemm, casts = fwd_s + fwd, bwd_gemm + bwd, casts + cast
        fwd_groups.append(fwd_s)
    routed = RoutedTimes()
    if moe:
        routed = routed_experts(job, tokens, kern, low if float8_experts else high, high, recipe, cast_mode, elementwise)
        fwd_groups[2] += moe * routed.up
        fwd_groups[3] += moe * routed.down
        bwd_gemm += moe * routed.bwd
        casts += moe * routed.cast_bytes
    cast_s = casts / cast_rate(kern, recipe, cast_mode)

    # Causal: half of the full matrices, q k^T's and the values' (x cp / cp); at the kernel's rate for
    # the query/key heads' width (MLA's, wider than its values, are priced so: an assumption). Such
    # heads SDPA runs on cuDNN's kernel, first on Hopper and Blackwell, which takes unequal query/key
    # and value widths; FlashAttention-2's needs them equal, so on Ampere it runs the memory-efficient
    # kernel (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: check_head_dim_size_flash,
    # check_cudnn_tensor_shapes), priced here on FlashAttention-2's curve.
    attn_flops = 2 * tokens * t.seq_len * heads * (m.head_size + m.v_head_size) / 2
    head_dim = head_dim_share(kern.head_dim, m.head_size, t.seq_len)
    attn_fwd = attn_flops / (attention_tflops(kern.attention_fwd, t.seq_len) * head_dim * 1e12)
    attn_bwd = 2.5 * attn_flops / (attention_tflops(kern.attention_bwd, t.seq_len) * head_dim * 1e12)

    f_units = ffn + moe * m.top_k * m.expert_hidden_dim
    rate = kern.elementwise_rate(compiled)  # [hbm]
    mem_fwd = elementwise_bytes(m, tp, elementwise, compiled, tokens, act, f_units) / rate
    mem_fwd += moe * routed.dispatch_bytes * act / 2 / rate
    # Memory-bound seconds of the forward and the backward: the tables', the float8 casts', and
    # under autocast with fp32 parameters its casts and fp32 residual stream (Elementwise).
    fwd_mem, bwd_mem = mem_fwd + cast_s / 3, 2 * mem_fwd + 2 * cast_s / 3
    autocast = autocast_replica(job)
    if autocast:
        weights = m.block_matmul_params(1)
        # torchao casts a float8 linear's fp32 weight itself; autocast the rest (a replica: whole shapes)
        cast_fwd = weights if low != "float8" else sum(k * n for name, (k, n) in block_linears(m).items()
                                                        if name not in converted)
        rows = 0.0 if compiled else tokens * m.dim  # compiled: fused, not counted (model_ops)
        fwd_mem += (rows * elementwise.autocast_bytes[0] + cast_fwd * elementwise.autocast_weight_bytes[0]) / rate
        bwd_mem += (rows * elementwise.autocast_bytes[1] + weights * elementwise.autocast_weight_bytes[1]) / rate

    fwd_gpu = sum(fwd_groups) + moe * routed.router + attn_fwd + fwd_mem
    bwd_gpu = bwd_gemm + 2 * moe * routed.router + attn_bwd + bwd_mem
    ops = elementwise.mla_ops[compiled][bool(m.q_lora_rank)] if m.mla else 0  # beyond Llama's attention
    host = ((elementwise.compiled_kernels + ops) * kern.host_compiled_s if compiled
            else (elementwise.eager_ops + ops) * kern.host_eager_s)
    host += moe * moe_host_s(job, kern, elementwise)
    if low == "float8":
        host += len(converted) * cast_host_s(kern, recipe, cast_mode, gathered8)
    fwd, bwd = max(fwd_gpu, host), max(bwd_gpu, 2 * host)
    if host > fwd_gpu:  # the host bounds the block: say why
        eager8 = low == "float8" and torchao_eager(recipe, cast_mode)
        notes.append(f"float8 without compile: torchao's casts and Python keep the host busy {host * 1e3:.1f} ms a "
                     f"block's forward, the GPU {fwd_gpu * 1e3:.1f} ms; compile.enable=true fuses the casts" if eager8
                     else "the host bounds a block: its Python and launches outlast the GPU's work (perf.gpu [host]; "
                     f"a Grace host's take {HOST_CPU['grace']:.2f}x an x86 one's); more tokens a microbatch hide them")
    # titan_exp.parallel.activation_checkpoint's per-op policy keeps attention and every other
    # matmul of the block (perf.shapes.selective_recomputed), and recomputes the rest: the routed
    # experts' grouped GEMMs (not aten.mm) whole.
    redone = selective_recomputed(m)
    selective = (sum(redone[name] * secs for name, secs in fwd_gemms.items()) + redone[ROUTER] * routed.router
                 + moe * (routed.up + routed.down) + fwd_mem)

    vocab = m.vocab_size / tp
    # The output layer, in high precision unless precision.filter_fqns leaves it to the converter.
    head_low = low != high and converts(pr, "output", m.dim, m.vocab_size)
    head_fwd, head_bwd, head_cast = linear_s(kern, tokens, m.dim, vocab, low if head_low else high, high, recipe,
                                             cast_mode)
    head_gemms = head_fwd + head_bwd
    logits = tokens * vocab * (elementwise.loss_bytes_compiled if compiled else elementwise.loss_bytes_eager) / rate
    logits += head_cast / cast_rate(kern, recipe, cast_mode) if head_low else 0.0
    if autocast:  # the output layer's weight cast (a float8 one's among its casts) and its gradient's (tied or not)
        logits += vocab * m.dim * elementwise.autocast_weight_bytes[1] / rate
        logits += 0.0 if head_low else vocab * m.dim * elementwise.autocast_weight_bytes[0] / rate
    kinds = {"fwd": {"gemm": sum(fwd_groups) + moe * routed.router, "attention": attn_fwd, "memory_bound": fwd_mem},
             "bwd": {"gemm": bwd_gemm + 2 * moe * routed.router, "attention": attn_bwd, "memory_bound": bwd_mem},
             "selective": {"gemm": selective - fwd_mem, "attention": 0.0, "memory_bound": fwd_mem},
             "head": {"gemm": head_gemms, "attention": 0.0, "memory_bound": logits}}
    return BlockTimes(fwd, bwd, selective, tuple(fwd_groups), head_gemms + logits, notes, kinds)


def memory_bound_bytes(table: tuple[float, float, float], tokens: float, act: int, d: float, heads: float,
                       kv: float, hd: int, f: float) -> float:
    """A block's memory-bound bytes forward on one rank (backward moves twice them): `table`, an
    Elementwise's bytes per token per unit of (dim, q + k heads x head_dim, SwiGLU width) for bf16
    activations, at `act`-byte ones; and, under GQA, K and V repeated to every query head before
    SDPA."""
    repeat = 2 * (kv + heads) * hd * act if kv < heads else 0.0
    return tokens * (act / 2 * (table[0] * d + table[1] * (heads + kv) * hd + table[2] * f) + repeat)


def elementwise_bytes(m: ModelConfig, tp: int, elementwise: Elementwise, compiled: bool, tokens: float, act: int,
                      f: float) -> float:
    """A block's memory-bound bytes forward on one TP rank, `tokens` tokens at `act`-byte
    activations and a SwiGLU `f` wide there, as `elementwise` counts its model's kernels, eager or
    `compiled`: memory_bound_bytes, its attention's part under multi-head latent attention in
    latent_bytes' terms instead."""
    table = elementwise.compiled_bytes if compiled else elementwise.eager_bytes
    if not m.mla:
        return memory_bound_bytes(table, tokens, act, m.dim / tp, m.n_heads // tp, m.kv_heads // tp, m.head_size, f)
    latents = elementwise.mla_compiled if compiled else elementwise.mla_eager
    return (memory_bound_bytes(table, tokens, act, m.dim / tp, 0, 0, m.head_size, f)
            + tokens * latent_bytes(m, tp, latents, act))


def latent_bytes(m: ModelConfig, tp: int, table: tuple[float, float, float, float], act: int) -> float:
    """Multi-head latent attention's memory-bound bytes a token forward on one TP rank, at `act`-byte
    activations: `table` (Elementwise.mla_eager or mla_compiled, for bf16) per unit of its heads'
    query/key width (n_heads / tp x head_size), of their rotated part (x qk_rope_head_dim), of its
    latents (q_lora_rank + kv_lora_rank: normalized whole on every TP rank) and of the key's shared
    rotated part."""
    heads = m.n_heads / tp
    units = (heads * m.head_size, heads * m.rope_dim, m.q_lora_rank + m.kv_lora_rank, m.rope_dim)
    return act / 2 * sum(c * u for c, u in zip(table, units))


def moe_host_s(job: JobConfig, kern: Kernels, elementwise: Elementwise) -> float:
    """An MoE layer's host seconds beyond the dense block's, forward: its ops (Elementwise.moe_ops)
    less the SwiGLU's it takes the place of (none where shared experts run one beside it), and,
    under EP, the exchange's (and, over TP's ranks too, the picking of a rank's own tokens), eager
    whether or not the job compiles (perf.model_ops)."""
    compiled, p = job.compile.enable, job.parallelism
    per_op = kern.host_compiled_s if compiled else kern.host_eager_s
    own = elementwise.moe_ops[compiled] - (0 if job.model.n_shared_experts else elementwise.ffn_ops[compiled])
    ep = 0
    if p.expert_parallel_degree > 1:
        ep = elementwise.ep_ops + (elementwise.ep_tp_ops if p.dispatch_split > 1 else 0)
    return own * per_op + ep * kern.host_eager_s


def linear_s(kern: Kernels, rows: float, k: float, n: float, dtype: str, high: str, recipe: str | None,
             casts: str, groups: float | None = None, weight_cast: bool = True) -> tuple[float, float, float]:
    """A linear layer (in k, out n) on `rows` rows, or `groups` of them in one grouped kernel,
    `rows` each: forward seconds (with fast accumulation, as torchao's forward GEMM runs, at its
    own measured rate where the profile has one: float8_fast, or rowwise scaling's, float8_rowwise,
    other kernels than tensorwise's), backward seconds (input gradient, and weight gradient:
    in `high` under rowwise_with_gw_hp; torchao runs them as tensorwise GEMMs) and, in float8, its
    casts' bytes as `casts` runs them (float8_casts; the weight's forward cast not among them
    where FSDP gathers it in float8: `weight_cast`)."""
    g = groups or 1
    forward = "float8_rowwise" if recipe in ("rowwise", "rowwise_with_gw_hp") else "float8_fast"
    fwd = gemm_s(kern, rows, n, k, forward if dtype == "float8" and forward in kern.matmul_tflops else dtype, groups)
    bwd = gemm_s(kern, rows, k, n, dtype, groups) + gemm_s(
        kern, k, n, rows, high if recipe == "rowwise_with_gw_hp" else dtype, groups)
    moved = (cast_bytes(g * rows * k, g * k * n, g * rows * n, recipe, casts, weight_cast)
             if dtype == "float8" else 0.0)
    return fwd, bwd, moved


@dataclass
class RoutedTimes:
    """One MoE layer's routed experts per microbatch on one rank: forward seconds of the w1/w3
    grouped GEMMs (`up`) and of w2's (`down`), backward GEMM seconds, the router's forward
    seconds, the float8 casts' bytes and the dispatch's bytes (in bf16); none for a dense layer."""

    up: float = 0.0
    down: float = 0.0
    bwd: float = 0.0
    router: float = 0.0
    cast_bytes: float = 0.0
    dispatch_bytes: float = 0.0


def routed_experts(job: JobConfig, tokens: float, kern: Kernels, dtype: str, high: str, recipe: str | None,
                   casts: str, elementwise: Elementwise) -> RoutedTimes:
    """An MoE layer's router and routed experts on one rank, for a microbatch of `tokens` tokens
    (all of them on every TP rank, which routes them all; under EP it dispatches its sequence
    shard's, 1/tp of them, as parallel.expert spreads EP over TP; without EP it runs all of them
    through its 1/tp of every expert's width, parallel.tensor). Its routed rows reach
    its n_experts / ep local experts, as many as it sends (balanced routing; an assumption), so
    each local expert's GEMMs have rows / local rows, in one grouped kernel (linear_s's groups):
    every local expert's weights are read whatever its rows, which is what expert parallel
    saves. The router's GEMM scores every expert in fp32. The dispatch copies the routed rows
    as `elementwise` counts, twice that in backward (with the rest of the memory-bound kernels)."""
    m, p = job.model, job.parallelism
    ep = p.expert_parallel_degree
    rows, local = tokens * m.top_k / p.dispatch_split, m.n_experts / ep
    d, h = m.dim, m.expert_hidden_dim / p.expert_width_split
    up = linear_s(kern, rows / local, d, h, dtype, high, recipe, casts, local)  # w1, and w3 alike
    down = linear_s(kern, rows / local, h, d, dtype, high, recipe, casts, local)
    f32 = "float32" if "float32" in kern.matmul_tflops else high
    router = gemm_s(kern, tokens, m.n_experts, d, f32)
    per_row, per_token = elementwise.dispatch_compiled if job.compile.enable else elementwise.dispatch_eager
    dispatch = d * (rows * (per_row + (EP_SORT_BYTES if ep > 1 else 0)) + tokens * per_token)
    return RoutedTimes(2 * up[0], down[0], 2 * up[1] + down[1], router, 2 * up[2] + down[2], dispatch)
