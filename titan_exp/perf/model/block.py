"""A GPU's training step from its parts: what each kernel of a block costs on a GPU
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
            (perf.rates.model_ops): LLAMA, this toolkit's, unless another model's is given (a published
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
            layer its router's, dispatch's and exchange's ops (perf.rates.model_ops counts them).
  head      the output projection's three GEMMs and the cross-entropy's bytes per logit (fp32
            upcast, log-softmax and its gradient; fused when compiled).
  MoE       an MoE layer's router (an fp32 GEMM), its routed experts as one grouped GEMM over the
            rank's n_experts / ep local experts (routed_experts: each expert's rows, and every
            local expert's weights read), and the dispatch's copies of the routed rows at HBM
            speed, as this toolkit's MoE layer moves them (Elementwise's dispatch bytes).

What of the communication these blocks' compute hides follows from the schedule: perf.model.overlap
(FSDP's gathers and reduce-scatters, async TP's collectives, a pipeline's sends), which perf.model.step
applies to them.

The rates each part runs at are a profile.Kernels: a spec sheet's (perf.rates.kernels, where each
rate's source is), or the GPU's own, measured by `python -m titan_exp.perf.calibrate` on it
(perf.calibration.kernels: the best-shaped GEMM by dtype, flash attention by sequence, memory-bound
kernels, host time per op and per compiled kernel, the grouped GEMM's share of the dense rate).
The same model prices a block from either.

Sources (checked 2026-11): the rates' ([mamf], [fa3], [cudnn-fe], [sdpa], [fa2], [hbm], [host],
[te-2053], [power]) are perf.rates.kernels'; and
  [torchao-eager] torchao's float8 casts without compile: perf.rates.float8_casts.
  [grouped] A grouped GEMM (torch._grouped_mm; Transformer Engine's grouped linears) is taken to
         run its tiles at the dense GEMM's rate (an assumption: no microbenchmark of these kernels
         is read here); calibrate measures the share on the GPU (Kernels.grouped_gemm_share).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from titan_exp.config import JobConfig, ModelConfig
from titan_exp.perf.model.engine import TITAN_EXP, Engine
from titan_exp.perf.model.memory_gpu import autocast_replica
from titan_exp.perf.model.shapes import (
    ROUTER,
    attention_on_rank,
    block_linears,
    float8_gathered,
    low_precision_linears,
    mean_ffn_width,
    selective_recomputed,
)
from titan_exp.perf.rates.float8_casts import cast_bytes, cast_host_s, cast_rate, recipe_of, torchao_eager
from titan_exp.perf.rates.kernels import HOST_CPU, attention_tflops, hbm, head_dim_share
from titan_exp.perf.rates.model_ops import EP_SORT_BYTES, Elementwise
from titan_exp.perf.rates.profile import Kernels
from titan_exp.precision import converts

TILE = 128  # a GEMM's output tile, rows and columns (cuBLAS's common large-GEMM tile; an assumption)


def wave_utilization(m: float, n: float, sms: int, groups: float = 1) -> float:
    """The share of the SMs' tile slots a GEMM's output fills (or `groups` outputs of m x n, one
    grouped kernel's): tiles of TILE x TILE, in waves of one tile per SM, the last wave and the
    edge tiles partly idle."""
    tiles = groups * math.ceil(m / TILE) * math.ceil(n / TILE)
    waves = math.ceil(tiles / sms)
    return groups * m * n / (waves * sms * TILE * TILE)


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
    # The GPU's work in the same seconds by kind of kernel (train.trace.KINDS: gemm, attention,
    # memory_bound), as a trace splits a step: a block's forward, its backward, what selective AC
    # recomputes, the head. The host's time, where it is longer, is not among them.
    kinds: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Setting:
    """What every part of a block's price reads: the job, its tokens a microbatch on one TP rank, the
    kernels' rates, the precisions (`high` the parameters'; `low` the converter's where the GPU has
    it), how float8 casts run, and which linears the converter takes."""

    job: JobConfig
    tp: int
    kern: Kernels
    engine: Engine
    tokens: float
    high: str
    low: str
    cast_mode: str
    recipe: str | None
    converted: frozenset
    gathered8: bool  # FSDP gathers the converted weights cast already (priced with the gather)

    @property
    def compiled(self) -> bool:
        return self.job.compile.enable

    @property
    def moe(self) -> float:
        """The share of the blocks that are MoE layers."""
        return self.job.model.n_moe_layers / self.job.model.n_layers

    @property
    def act(self) -> int:
        return 2 if self.high == "bfloat16" else 4


def _setting(job: JobConfig, tp: int, kern: Kernels, engine: Engine) -> tuple[_Setting, list[str]]:
    """The block's setting, and what it says of precision (no FP8 tensor cores; linears kept)."""
    t, p, pr = job.training, job.parallelism, job.precision
    mb = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else t.local_batch_size
    high = "bfloat16" if pr.param_dtype == "bfloat16" or pr.full_bf16 else "float32"
    low = "float8" if pr.converter != "none" and "float8" in kern.matmul_tflops else high
    notes = [f"this GPU has no FP8 tensor cores: float8 at {high}"] if pr.converter != "none" and low != "float8" \
        else []
    converted = low_precision_linears(job) if low != high else frozenset()  # the rest run in `high`
    names = block_linears(job.model)
    if low != high and len(converted) < len(names):
        kept = ", ".join(name for name in names if name not in converted)
        notes.append(f"{pr.converter}: {kept} stay in {high} (precision.filter_fqns {list(pr.filter_fqns)}), priced so")
    cast_mode = "compiled" if job.compile.enable else engine.elementwise.float8_casts
    return _Setting(job, tp, kern, engine, mb * t.seq_len / p.context_parallel_degree, high, low, cast_mode,
                    recipe_of(job), converted, float8_gathered(job)[0] > 0), notes


@dataclass
class _Gemms:
    """A block's linears: the forward seconds of each GEMM group async TP fuses a collective with, of
    each linear, the backward's, and the bytes their float8 casts move; an MoE layer's routed experts."""

    fwd_groups: list[float]
    fwd: dict[str, float]
    bwd: float
    cast_bytes: float
    routed: RoutedTimes


def _gemms(b: _Setting) -> _Gemms:
    """The linears of a block, in (in, out) shapes on one TP rank, by the groups async TP fuses:
    attention's q, k, v (MLA's projections to and from its latents) and o (perf.model.shapes); the
    SwiGLU's w1 and w3, and w2; an MoE layer's routed experts added to the feed-forward's groups."""
    attention, ffn = attention_on_rank(b.job.model, b.tp), mean_ffn_width(b.job.model) / b.tp
    up, down = (b.job.model.dim, ffn), (ffn, b.job.model.dim)
    groups = [{name: shape for name, shape in attention.items() if name != "attention.wo"},
              {"attention.wo": attention["attention.wo"]}, {"feed_forward.w1": up, "feed_forward.w3": up},
              {"feed_forward.w2": down}]
    out = _Gemms([], {}, 0.0, 0.0, RoutedTimes())
    for group in groups:
        fwd_s = 0.0
        for name, (k, n) in group.items():
            dtype = b.low if name in b.converted else b.high
            fwd, bwd, cast = linear_s(b.kern, b.tokens, k, n, dtype, b.high, b.recipe, b.cast_mode,
                                      weight_cast=not b.gathered8)
            out.fwd[name] = fwd
            fwd_s, out.bwd, out.cast_bytes = fwd_s + fwd, out.bwd + bwd, out.cast_bytes + cast
        out.fwd_groups.append(fwd_s)
    if b.moe:
        experts = b.low if b.engine.float8_experts else b.high
        out.routed = r = routed_experts(b.job, b.tokens, b.kern, experts, b.high, b.recipe, b.cast_mode,
                                        b.engine.elementwise)
        out.fwd_groups[2] += b.moe * r.up
        out.fwd_groups[3] += b.moe * r.down
        out.bwd += b.moe * r.bwd
        out.cast_bytes += b.moe * r.cast_bytes
    return out


def _attention(b: _Setting) -> tuple[float, float]:
    """Attention's seconds forward and backward. Causal: half of the full matrices, q k^T's and the
    values' (x cp / cp); at the kernel's rate for the query/key heads' width (MLA's, wider than its
    values, are priced so: an assumption). Such heads SDPA runs on cuDNN's kernel, first on Hopper and
    Blackwell, which takes unequal query/key and value widths; FlashAttention-2's needs them equal, so
    on Ampere it runs the memory-efficient kernel (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:
    check_head_dim_size_flash, check_cudnn_tensor_shapes), priced here on FlashAttention-2's curve."""
    m, seq, kern = b.job.model, b.job.training.seq_len, b.kern
    flops = 2 * b.tokens * seq * (m.n_heads // b.tp) * (m.head_size + m.v_head_size) / 2
    head_dim = head_dim_share(kern.head_dim, m.head_size, seq)
    return (flops / (attention_tflops(kern.attention_fwd, seq) * head_dim * 1e12),
            2.5 * flops / (attention_tflops(kern.attention_bwd, seq) * head_dim * 1e12))


def _memory_bound(b: _Setting, routed: RoutedTimes, cast_s: float) -> tuple[float, float]:
    """Memory-bound seconds of the forward and the backward: the model's kernels (Elementwise), the
    float8 casts', and under autocast with fp32 parameters its casts and fp32 residual stream."""
    m, elementwise, compiled = b.job.model, b.engine.elementwise, b.compiled
    f_units = mean_ffn_width(m) / b.tp + b.moe * m.top_k * m.expert_hidden_dim
    rate = b.kern.elementwise_rate(compiled)  # [hbm]
    mem_fwd = elementwise_bytes(m, b.tp, elementwise, compiled, b.tokens, b.act, f_units) / rate
    mem_fwd += b.moe * routed.dispatch_bytes * b.act / 2 / rate
    fwd_mem, bwd_mem = mem_fwd + cast_s / 3, 2 * mem_fwd + 2 * cast_s / 3
    if autocast_replica(b.job):
        weights = m.block_matmul_params(1)
        # torchao casts a float8 linear's fp32 weight itself; autocast the rest (a replica: whole shapes)
        cast_fwd = weights if b.low != "float8" else sum(k * n for name, (k, n) in block_linears(m).items()
                                                          if name not in b.converted)
        rows = 0.0 if compiled else b.tokens * m.dim  # compiled: fused, not counted (model_ops)
        fwd_mem += (rows * elementwise.autocast_bytes[0] + cast_fwd * elementwise.autocast_weight_bytes[0]) / rate
        bwd_mem += (rows * elementwise.autocast_bytes[1] + weights * elementwise.autocast_weight_bytes[1]) / rate
    return fwd_mem, bwd_mem


def _host(b: _Setting) -> float:
    """The host's seconds of a block's forward: its Python and launches, eager or compiled."""
    m, elementwise, kern = b.job.model, b.engine.elementwise, b.kern
    ops = elementwise.mla_ops[b.compiled][bool(m.q_lora_rank)] if m.mla else 0  # beyond Llama's attention
    ops += elementwise.qk_norm_ops[b.compiled] if m.qk_norm else 0
    host = ((elementwise.compiled_kernels + ops) * kern.host_compiled_s if b.compiled
            else (elementwise.eager_ops + ops) * kern.host_eager_s)
    host += b.moe * moe_host_s(b.job, kern, elementwise)
    if b.low == "float8":
        host += len(b.converted) * cast_host_s(kern, b.recipe, b.cast_mode, b.gathered8)
    return host


def _host_note(b: _Setting, host: float, fwd_gpu: float) -> str:
    """Why the host bounds the block."""
    if b.low == "float8" and torchao_eager(b.recipe, b.cast_mode):
        return (f"float8 without compile: torchao's casts and Python keep the host busy {host * 1e3:.1f} ms a "
                f"block's forward, the GPU {fwd_gpu * 1e3:.1f} ms; compile.enable=true fuses the casts")
    return ("the host bounds a block: its Python and launches outlast the GPU's work (perf.model.block [host]; "
            f"a Grace host's take {HOST_CPU['grace']:.2f}x an x86 one's); more tokens a microbatch hide them")


def _head(b: _Setting) -> tuple[float, float]:
    """The output layer's GEMMs and the loss's memory-bound seconds, forward and backward: the layer
    in high precision unless precision.filter_fqns leaves it to the converter."""
    m, pr, kern, elementwise = b.job.model, b.job.precision, b.kern, b.engine.elementwise
    vocab = m.vocab_size / b.tp
    rate = kern.elementwise_rate(b.compiled)
    head_low = b.low != b.high and converts(pr, "output", m.dim, m.vocab_size)
    head_fwd, head_bwd, head_cast = linear_s(kern, b.tokens, m.dim, vocab, b.low if head_low else b.high, b.high,
                                             b.recipe, b.cast_mode)
    loss = elementwise.loss_bytes_compiled if b.compiled else elementwise.loss_bytes_eager
    logits = b.tokens * vocab * loss / rate
    logits += head_cast / cast_rate(kern, b.recipe, b.cast_mode) if head_low else 0.0
    if autocast_replica(b.job):  # the output layer's weight cast (a float8 one's among its casts) and its gradient's
        logits += vocab * m.dim * elementwise.autocast_weight_bytes[1] / rate
        logits += 0.0 if head_low else vocab * m.dim * elementwise.autocast_weight_bytes[0] / rate
    return head_fwd + head_bwd, logits


def block_times(job: JobConfig, tp: int, kern: Kernels, engine: Engine = TITAN_EXP) -> BlockTimes:
    """One block's and the head's seconds per microbatch, as `engine` runs it: its memory-bound
    kernels as engine.elementwise counts them; an MoE's routed experts in bf16 under a float8
    recipe, as this toolkit's (precision.apply_converter leaves them), unless engine.float8_experts
    (Transformer Engine's grouped linears take the recipe). A pass takes the longer of the GPU's
    work and the host's."""
    b, notes = _setting(job, tp, kern, engine)
    g = _gemms(b)
    routed, moe = g.routed, b.moe
    attn_fwd, attn_bwd = _attention(b)
    fwd_mem, bwd_mem = _memory_bound(b, routed, g.cast_bytes / cast_rate(kern, b.recipe, b.cast_mode))
    fwd_gpu = sum(g.fwd_groups) + moe * routed.router + attn_fwd + fwd_mem
    bwd_gpu = g.bwd + 2 * moe * routed.router + attn_bwd + bwd_mem
    host = _host(b)
    fwd, bwd = max(fwd_gpu, host), max(bwd_gpu, 2 * host)
    if host > fwd_gpu:
        notes.append(_host_note(b, host, fwd_gpu))
    # titan_exp.parallel.activation_checkpoint's per-op policy keeps attention and every other matmul
    # of the block (perf.model.shapes.selective_recomputed), and recomputes the rest: the routed
    # experts' grouped GEMMs (not aten.mm) whole.
    redone = selective_recomputed(job.model)
    selective = (sum(redone[name] * secs for name, secs in g.fwd.items()) + redone[ROUTER] * routed.router
                 + moe * (routed.up + routed.down) + fwd_mem)
    head_gemms, logits = _head(b)
    kinds = {"fwd": {"gemm": sum(g.fwd_groups) + moe * routed.router, "attention": attn_fwd, "memory_bound": fwd_mem},
             "bwd": {"gemm": g.bwd + 2 * moe * routed.router, "attention": attn_bwd, "memory_bound": bwd_mem},
             "selective": {"gemm": selective - fwd_mem, "attention": 0.0, "memory_bound": fwd_mem},
             "head": {"gemm": head_gemms, "attention": 0.0, "memory_bound": logits}}
    return BlockTimes(fwd, bwd, selective, tuple(g.fwd_groups), head_gemms + logits, notes, kinds)


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
    if m.qk_norm:  # read and written once more per query and key element (Elementwise.qk_norm_bytes)
        table = (table[0], table[1] + elementwise.qk_norm_bytes[compiled], table[2])
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
    whether or not the job compiles (perf.rates.model_ops)."""
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
