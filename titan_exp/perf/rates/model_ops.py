"""What a model's code runs beside its GEMMs and attention, per block: the bytes its
memory-bound kernels move and the ops its host issues, eager and as compile fuses them
(`Elementwise`), for this toolkit's Llama and MoE layer (`LLAMA`), counted on them by
tests/test_gpu_model.py. perf.model.block.block_times prices them; another engine's model is described
the same way (benchmarks/published/engines.py)."""

from __future__ import annotations

from dataclasses import dataclass

# Host ops of this toolkit's routed experts on a CUDA bf16 forward (below LLAMA: what they are).
GROUPED_EXPERT_OPS = 6


@dataclass(frozen=True)
class Elementwise:
    """A model's memory-bound kernels, as its code runs them: HBM bytes per token of a block's
    forward per unit of (dim, q + k heads x head_dim, SwiGLU width) on one TP rank, eager and as
    compile fuses them (backward moves twice the forward's); the ops of a block's forward eager,
    its kernels compiled (host time; backward: x2); and the loss's bytes per logit, forward and
    backward together."""

    eager_bytes: tuple[float, float, float]
    compiled_bytes: tuple[float, float, float]
    eager_ops: int
    compiled_kernels: int
    loss_bytes_eager: float
    loss_bytes_compiled: float
    # An MoE layer's dispatch and router, per unit of dim: (bytes per routed row, bytes per
    # token), eager and compiled; this toolkit's MoE unless said (below LLAMA).
    dispatch_eager: tuple[float, float] = (26, 12)
    dispatch_compiled: tuple[float, float] = (6, 12)
    # Whose float8 casts run without compile (float8_casts.CASTS): torchao's, as this toolkit's (separate
    # kernels and Python, [torchao-eager]); or Transformer Engine's.
    float8_casts: str = "torchao"
    # Host ops of an MoE layer's forward (eager, compiled), of the dense SwiGLU it takes the place
    # of (eager, compiled; among eager_ops and compiled_kernels), and what expert parallel's
    # exchange adds (eager under compile too), and, where EP spreads over TP, picking the TP rank's
    # own tokens; this toolkit's MoE unless said (below LLAMA).
    moe_ops: tuple[int, int] = (21 + GROUPED_EXPERT_OPS, 17)
    ffn_ops: tuple[int, int] = (5, 4)
    ep_ops: int = 22
    ep_tp_ops: int = 13
    # One replica under bf16 autocast with fp32 parameters (perf.model.memory_gpu.autocast_replica: no
    # FSDP to cast them): bytes per token per unit of dim beyond the tables above, forward and
    # backward, eager; and bytes per parameter of a bf16 linear, its weight's cast forward and its
    # gradient's cast back (below LLAMA: what they are).
    autocast_bytes: tuple[float, float] = (46, 48)
    autocast_weight_bytes: tuple[float, float] = (6, 6)
    # Multi-head latent attention's memory-bound kernels in place of the (q + k heads x head_dim)
    # unit above, bytes a token per unit of (heads x query/key width, heads x its rotated part, the
    # latents' widths, the key's shared rotated part), eager and compiled; and its ops beyond
    # Llama's attention (eager, compiled) x (without, with a query latent). This toolkit's MLA
    # unless said (below LLAMA: what they are).
    mla_eager: tuple[float, float, float, float] = (12, 94, 4, 2)
    mla_compiled: tuple[float, float, float, float] = (8, 0, 4, 2)
    mla_ops: tuple[tuple[int, int], tuple[int, int]] = ((2, 4), (1, 2))
    # QK-norm (Qwen3, model.qk_norm): bytes a token forward per unit of (q + k heads x head_dim)
    # beyond the table's, and its kernels, eager and compiled (below LLAMA: what they are).
    qk_norm_bytes: tuple[float, float] = (4, 0)
    qk_norm_ops: tuple[int, int] = (2, 0)


# This toolkit's Llama (titan_exp.models.llama) on a CUDA torch (2.11, 2.13), bytes per token of a
# block's forward in bf16. Eager: nn.RMSNorm runs torch's fused kernel (aten._fused_rms_norm),
# reading and writing the row, 4 x 2; residual adds 6 x 2; RoPE in fp32 from real and imaginary
# halves (upcast 6, four products 16, a difference and a sum 12, the stack 8, the cast back 6),
# 48; SiLU and product 10; SDPA's flash kernel writes its output as the next matmul reads it (no
# copy: so on CPU; a GPU run is to confirm it). 34 ops that launch a kernel (tests/test_gpu_model.py
# counts them and these bytes on this toolkit's block on CPU, the norms as the fused kernel's), of
# which the SwiGLU's three matmuls, SiLU and product are 5.
# Compiled: each norm with its residual add 6 x 2, RoPE 4, SiLU and product 6, 13 kernels (the
# SwiGLU's: its three GEMMs and one fused SiLU and product). The loss: the fp32 upcast,
# log-softmax and its gradient, 36 eager, 10 fused.
LLAMA = Elementwise(eager_bytes=(2 * 4 + 2 * 6, 48, 10), compiled_bytes=(2 * 6, 4, 6),
                    eager_ops=34, compiled_kernels=13, loss_bytes_eager=36, loss_bytes_compiled=10)
# An MoE layer of titan_exp.models.moe in bf16 (Elementwise's dispatch defaults), bytes per unit of
# dim of a forward. Per routed row (token x choice), eager: the gather into expert order (read,
# write) 4, the upcast 6, the product with the routing weight 8, the cast back 6, index_add's read
# 2: 26; compiled, the gather 4 and one fused weigh-and-add reading the rows 2: 6. Per token: the
# router's fp32 copy of its input 6, the zeroed output 2, index_add's read and write 4: 12, eager
# and compiled. Under EP each rank also sorts what it receives by expert and back (two gathers,
# EP_SORT_BYTES per routed row). Transformer Engine's fused permute and unpermute and its fp32
# router (Megatron's rows) are taken to move what compile's kernels do (an assumption).
EP_SORT_BYTES = 8
# Its host ops, a training forward (Elementwise's moe_ops and ep_ops defaults): 21 outside the
# experts (the router's casts, GEMM, softmax, bias, top-k and weights; the counts and the step's
# running total; the sort, the token indices and the gather of the rows; the weighting with its
# casts and the index-add onto a zeroed output), counted on CPU by tests/test_gpu_model_moe.py, and
# GROUPED_EXPERT_OPS inside them, as a CUDA bf16 forward takes torch._grouped_mm
# (GroupedExperts.forward: the offsets' cumsum, three grouped GEMMs, SiLU, the product; read from
# the code, CPU runs a loop instead). Compiled, 17: the pointwise ops fused into their neighbours
# (the router's softmax with its bias, the weights' gather with their product, the rows' gather
# with its cast, SiLU with the product, the weighting with its cast), the zero fills, top-k, the
# sort, the scatter- and index-adds, the cumsum and the GEMMs kernels of their own (an
# assumption: Inductor's kernels are a GPU's to count). Under EP the exchange adds 22 ops,
# counted the same way on a one-rank group: the counts' all-to-all and its wait, the rows' sums
# to send and receive, joined for the one .tolist() that waits for the GPU, the rows' two
# all-to-alls, the regrouping by expert; eager under compile, where .tolist() breaks the graph.
# Where EP spreads over TP, a TP rank's own tokens add 13 (their pairs' indices from aranges, the
# sort of their experts, their counts), counted the same way on one-rank groups.
# Megatron's MoE layer (the published rows) is taken to issue as many (an assumption).
# Under bf16 autocast with fp32 parameters (a single GPU's run: no FSDP casts them), the residual
# stream and the norms stay fp32 and autocast casts each linear's input and weight to bf16 on its
# own: forward, the five casts of the normed rows (q, k, v; w1, w3) 5 x 6, the two residual adds
# reading and writing fp32 2 x 4 more, the two norms 2 x 4 more: 46 a token per unit of dim;
# backward 48 (the casts' gradients back to fp32 and their sums in fp32); each weight 6 a
# parameter forward, its bf16 gradient cast to fp32 6 backward. Counted on this toolkit's block
# under CPU autocast by tests/test_gpu_model.py, eager; compiled, Inductor fuses the activations'
# part into its kernels (not counted: the tables above stand), and the weights' casts remain.
# A float8 linear (torchao's) casts its fp32 weight to float8 in as many bytes as a bf16 one (no
# forward cast to bf16 beside it), and its weight's gradient to fp32 all the same, 6 backward:
# counted on torchao's Float8Linear under CPU autocast, by the same test file.
# Multi-head latent attention (titan_exp.models.mla) in bf16, eager, counted on its block by
# tests/test_gpu_model.py (the latents' norms as the fused kernel a CUDA torch runs): per unit of
# heads x query/key width 12 (joining each head's two parts, q's once and k's twice: read both,
# write the whole, 4 each; k's RoPE-less part read once more, 2 less per rotated column, counted
# there), per unit of heads x rotated width 94 (RoPE in fp32 on q's and k's rotated parts, 48 each,
# the shared part read where k is joined, less 2), per unit of the latents 4 (each norm reads and
# writes it), per unit of the shared rotated width 2 (its read as k is joined). Its forward has 4
# more ops than Llama's with a query latent (its norm, the joins; one GEMM more), 2 without.
# Compiled, an assumption as Llama's compiled table is: q and k read and written once each
# (4 a unit of their widths, as Llama's RoPE compiled), the norms and the shared part as eager;
# 2 kernels more with a query latent (its GEMM and norm), 1 without.
# QK-norm (Qwen3's): eager, a fused norm each over the queries and the keys before RoPE, reading
# and writing them (2 x 2 bytes a unit of their width), 2 kernels; counted on this toolkit's block
# by tests/planner/test_gpu_model.py. Compiled, an assumption: Inductor fuses each head's norm into the
# RoPE kernel that reads and writes the head anyway, nothing more.
