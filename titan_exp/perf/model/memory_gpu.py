"""What a GPU rank's memory holds beyond the tensors perf.model.memory counts, part by part. The memory
model reads it for plans on CUDA (predict_memory(..., cuda=True)).

  rounding     PyTorch's caching allocator [cca] rounds every request up to a multiple of 512
               bytes and serves it from a segment it reserved with cudaMalloc: a request of up to
               1 MiB from 2 MiB segments, one under 10 MiB from 20 MiB segments (either is split
               among requests of that pool), a larger one from a segment of its own, rounded up to
               2 MiB. `reserved` is what a number of live requests of one size take; the rounding
               part is that less their bytes, over the tensors a step allocates whose sizes the
               model knows (`step_tensors`).
  workspaces   cuBLAS's workspace [cublas], which PyTorch allocates through the caching allocator,
               one per cuBLAS handle and stream that runs GEMMs, and cuBLASLt's beside it. A
               training step runs GEMMs on two: the forward on the main thread, the backward on
               autograd's device thread, each with its own handle (PyTorch's handle pool is per
               thread). Once per process: not per block, not per layout.
  float8       torchao's Float8Linear [f8] saves the high-precision input and weight for backward,
               so a block's saved activations are bf16 as without it; its float8 copies are
               transient: the ones alive at once are those of the linear whose backward runs,
               the output gradient cast twice (for the input gradient's GEMM and, along the other
               axis, the weight gradient's), the input cast for the weight gradient's, the weight
               cast for the input gradient's (one byte an element), with their scales: tensorwise,
               one fp32 each (a 512-byte block); rowwise, one fp32 a row; MXFP8, one byte per 32
               elements. rowwise_with_gw_hp runs the weight gradient's GEMM in bf16, on the
               tensors themselves. Assumed: torch.compile keeps the same tensors (its partitioner
               may save a float8 copy instead of the bf16 input; that is not counted). Under
               FSDP's float8 all-gather the gathered weight is the forward's float8 copy (the
               working set, perf.model.memory); the backward's transposed copy is as here.
  nccl         NCCL's buffers [nccl], which NCCL allocates itself, outside PyTorch's allocator: not
               in the reserved peak that TorchTitan reports and the planner compares with a
               GPU's memory, but in what nvidia-smi shows. Per communicator, per channel, one
               ring connection's receive buffers of the three protocols (Simple, LL128, LL).
               Assumed: 16 channels per communicator (an 8-GPU NVLink node's usual ring count; NCCL
               picks it from the topology), one communicator per process group a step uses (each
               mesh dimension over 1, FSDP's dp_shard x cp when cp > 1, and the world's); trees,
               NVLink SHARP and the proxy's host buffers are not counted.

The fragmentation the allocator adds beyond rounding, segments split and cached where a later
request does not fit, is no part here: with expandable segments (cluster.cuda_expandable_segments,
the default, as TorchTitan's launcher sets) a segment grows in place, and it is not priced.

One replica under autocast (`autocast_peak`): a job without FSDP, TP, PP or CP runs its forward
and backward under bf16 autocast (titan_exp.precision.autocast_dtype) with fp32 parameters, and
its memory is counted part by part at the three moments its peak can be, nothing fitted but what
is named so:
  backward's start  the parameters and AdamW's moments (12 bytes a parameter; the gradients, set
                    to None after each step, exist only from a second microbatch on), autocast's
                    bf16 copies of the weights it casts, which the backward keeps until each
                    linear's has run (eager, every linear under bf16, the output layer alone
                    under float8, whose linears cast their fp32 weights themselves; compiled, the
                    output layer alone, the compiled blocks casting their weights again in the
                    backward: no block's copy was live at the compiled 3B's peak in its
                    memory snapshot, benchmarks/data/gpu_h200_memory_peak_3b.json), what every
                    block saves (AUTOCAST_SAVED) or, under full AC, each block's fp32 input and one
                    block recomputed, and the loss (LOSS_UNITS);
  backward's end    16 bytes a parameter with the gradients (the copies freed by then);
  the update        16 bytes a parameter, and the foreach AdamW's temporaries (FOREACH_UPDATE).
The allocator's cache beyond these tensors (0.3-7 % of the reserved peak on the H200's rows,
BENCHMARKS.md) is not priced here. The account was written after those rows were measured (two of
its values were inferred from them: CUDA_EXTRA); its held-out check is the next GPU's
grid (benchmarks/gpu_grid.py), named so in BENCHMARKS.md.

Sources (checked 2026-11):
  [cca]    c10/core/AllocatorConfig.h (kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer 2 MiB,
           kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB; the large segment kLargeBuffer, 20 MiB, is
           AcceleratorAllocatorConfig::large_segment_size() in PyTorch 2.9+) and
           c10/cuda/CUDACachingAllocator.cpp (round_size, get_allocation_size, should_split: a
           small-pool block splits off any remainder of 512 bytes or more, a large-pool block one
           over 1 MiB), pytorch/pytorch.
  [cublas] aten/src/ATen/cuda/CublasHandlePool.cpp, pytorch/pytorch: parseChosenWorkspaceSize,
           the default of CUBLAS_WORKSPACE_CONFIG: 32 MiB (:4096:8) on Hopper and Blackwell,
           :4096:2:16:8 (8 MiB + 128 KiB) before; parseCUDABlasLtWorkspaceSize, the default of
           CUBLASLT_WORKSPACE_SIZE: 1024 KiB (newer PyTorch may share cuBLAS's instead,
           TORCH_CUBLASLT_UNIFIED_WORKSPACE: at most a 2 MiB segment less).
  [f8]     torchao/float8/float8_linear.py, pytorch/ao 0.18: matmul_with_hp_or_float8_args
           (save_for_backward(input_hp, weight_hp_t); backward casts grad_output along both axes,
           the weight and the input).
  [nccl]   NCCL src/init.cc, NVIDIA/nccl: DEFAULT_BUFFSIZE 4 MiB (NCCL_BUFFSIZE, in NCCL's
           documented environment variables), DEFAULT_LL128_BUFFSIZE 120 x 640 x 8 x 8 =
           4,915,200 bytes, DEFAULT_LL_BUFFSIZE 8 x 512 x 8 x 16 = 512 KiB.
"""

from __future__ import annotations

import math

from titan_exp.config import ACMode, JobConfig
from titan_exp.perf.model.shapes import (
    Sizes,
    attention_on_rank,
    block_linears,
    block_tensors,
    low_precision_linears,
    mean_ffn_width,
)

MIB = 2**20
MIN_BLOCK = 512  # [cca] kMinBlockSize
SMALL_SIZE = 1 * MIB  # [cca] kSmallSize: the largest request of the small pool
SMALL_SEGMENT = 2 * MIB  # [cca] kSmallBuffer
LARGE_SEGMENT = 20 * MIB  # [cca] kLargeBuffer / large_segment_size
MIN_LARGE_ALLOC = 10 * MIB  # [cca] kMinLargeAlloc: from here a request has a segment of its own
ROUND_LARGE = 2 * MIB  # [cca] kRoundLarge
CUBLAS_WORKSPACE = {"hopper": 32 * MIB, "blackwell": 32 * MIB}  # [cublas]; other architectures:
CUBLAS_WORKSPACE_BEFORE_HOPPER = 4096 * 1024 * 2 + 16 * 1024 * 8  # [cublas] :4096:2:16:8
CUBLASLT_WORKSPACE = 1 * MIB  # [cublas]
GEMM_STREAMS = 2  # (handle, stream) pairs running GEMMs: forward's thread and autograd's
NCCL_CHANNEL_BYTES = 4 * MIB + 120 * 640 * 8 * 8 + 8 * 512 * 8 * 16  # [nccl] Simple + LL128 + LL
NCCL_CHANNELS = 16  # an assumption (see nccl above)
DDP_BUCKET = 25 * MIB  # DistributedDataParallel's bucket_cap_mb default


def reserved(size: float, count: float = 1.0) -> float:
    """Bytes the caching allocator reserves for `count` live requests of `size` bytes each [cca]:
    each rounded up to 512 bytes; up to 1 MiB, as many as fit share a 2 MiB segment; under
    10 MiB, a 20 MiB segment; larger, each its own segment rounded up to 2 MiB."""
    if size <= 0 or count <= 0:
        return 0.0
    rounded = MIN_BLOCK * math.ceil(size / MIN_BLOCK)
    if rounded >= MIN_LARGE_ALLOC:
        return count * ROUND_LARGE * math.ceil(rounded / ROUND_LARGE)
    segment = SMALL_SEGMENT if rounded <= SMALL_SIZE else LARGE_SEGMENT
    return math.ceil(count / (segment // rounded) - 1e-9) * segment


def rounding(sizes: Sizes) -> float:
    """What the allocator reserves for these tensors (bytes, how many live) beyond their bytes."""
    return sum(reserved(b, k) - b * k for b, k in sizes if b > 0 and k > 0)


def workspaces(architecture: str) -> float:
    """Bytes reserved for cuBLAS's and cuBLASLt's workspaces in a training process [cublas]."""
    cublas = CUBLAS_WORKSPACE.get(architecture, CUBLAS_WORKSPACE_BEFORE_HOPPER)
    return reserved(cublas, GEMM_STREAMS) + reserved(CUBLASLT_WORKSPACE, GEMM_STREAMS)


def nccl(job: JobConfig) -> float:
    """Bytes of NCCL's buffers in a rank, outside PyTorch's allocator [nccl]."""
    p = job.parallelism
    groups = [d for d in (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
                          p.tensor_parallel_degree, p.pipeline_parallel_degree) if d > 1]
    if p.expert_parallel_degree > 1:
        groups.append(p.expert_parallel_degree)
    if p.context_parallel_degree > 1 and p.data_parallel_shard_degree > 1:
        groups.append(p.data_parallel_shard_degree * p.context_parallel_degree)  # FSDP's mesh
    return (len(groups) + 1) * NCCL_CHANNELS * NCCL_CHANNEL_BYTES if groups else 0.0


def float8_tensors(job: JobConfig, tokens: float) -> Sizes:
    """The float8 copies and scales alive at once [f8]: those of the block's linear (on one TP
    rank, over the microbatch's `tokens`) whose backward holds the most. None without a float8
    converter."""
    pr, m = job.precision, job.model
    if pr.converter == "none":
        return []
    recipe = pr.float8_recipe if pr.converter == "float8" else "mxfp8"
    tp = job.parallelism.tensor_parallel_degree
    ffn = mean_ffn_width(m)
    shapes = attention_on_rank(m, tp) | {"feed_forward.w1": (m.dim, ffn / tp), "feed_forward.w3": (m.dim, ffn / tp),
                                         "feed_forward.w2": (ffn / tp, m.dim)}
    low = low_precision_linears(job)
    linears = [shape for name, shape in shapes.items() if name in low]
    if not linears:
        return []

    def copies(k: float, n: float) -> Sizes:  # (elements, rows) of each float8 tensor of one linear's backward
        out = [(tokens * n, tokens), (k * n, n)]  # output gradient (input gradient's GEMM), weight
        if recipe != "rowwise_with_gw_hp":
            out += [(tokens * n, n), (tokens * k, k)]  # output gradient and input along the other axis
        return out

    def sizes(k: float, n: float) -> Sizes:
        data = [(elements, 1.0) for elements, _ in copies(k, n)]
        if recipe == "tensorwise":
            scales = [(4.0, 1.0)] * len(data)
        elif recipe == "mxfp8":
            scales = [(elements / 32, 1.0) for elements, _ in copies(k, n)]
        else:
            scales = [(4 * rows, 1.0) for _, rows in copies(k, n)]
        return data + scales

    return max((sizes(k, n) for k, n in linears), key=lambda s: sum(b * c for b, c in s))


def step_tensors(job: JobConfig, *, tokens: float, act_bytes: int, gathered: int, working: float, fsdp: bool,
                 saved: tuple[float, float], checkpoints: float, logits: bool, float8: Sizes) -> Sizes:
    """The tensors a step allocates and frees, as (bytes, how many live at the peak), from the
    memory model's parts: the working set as FSDP's per-weight gathered tensors and unsharded
    gradients (shaped as the block's weights), DDP's 25 MiB buckets, or under TP alone the
    embedding's whole gradient; the saved activations (`saved`: bytes in tensors of tokens x dim,
    and of tokens x the SwiGLU width, on one TP rank); the checkpointed block inputs; the logits
    (bf16 and two fp32: the loss's copy and its gradient); the float8 copies. The states,
    allocated once and packed, are not among them."""
    m, p = job.model, job.parallelism
    tp = p.tensor_parallel_degree
    out: Sizes = []
    if working and fsdp:
        weights = [(n * gathered, k) for n, k in block_tensors(job)]
        copies = working / sum(b * k for b, k in weights)
        out += [(b, k * copies) for b, k in weights]
    elif working and p.data_parallel_replicate_degree > 1:
        out.append((DDP_BUCKET, working / DDP_BUCKET))
    elif working:
        out.append((working, 1.0))
    d, h = tokens * m.dim * act_bytes / tp, tokens * m.ffn_hidden_dim * act_bytes / tp
    out += [(size, total / size) for size, total in ((d, saved[0]), (h, saved[1]), (d, checkpoints)) if size > 0]
    if logits:
        vocab = m.vocab_size / (1 if p.disable_loss_parallel else tp)
        out += [(tokens * vocab * act_bytes, 1.0), (tokens * vocab * 4, 2.0)]
    return out + float8


# What one of this toolkit's blocks (titan_exp.models.llama) saves for backward under bf16 autocast,
# bytes a token, eager, compiled, or under selective AC per op, in bf16 or float8: coefficients of
# dim d, the SwiGLU width f, the query heads' width q (n_heads x head_dim), the KV heads' width kv,
# the heads h, and bytes. Counted with autograd's saved-tensor hooks on the block at Llama 3's 1B
# and 3B shapes on CPU, and checked to the byte at the 8B's (tests/test_gpu_h200.py recounts them);
# d's terms told from q's on blocks whose heads are twice dim wide together, or half (Qwen3's are
# 128 wide at any dim; tests/planner/test_memory_qwen3.py recounts them). The block's fp32 input
# is not among them (the block before made it). Selective AC is counted compiled; eager, the
# policy keeps the same outputs (an assumption: the hooks cannot see inside it).
AUTOCAST_SAVED = {  # (mode, float8) -> (d, f, q, kv, h, bytes)
    ("eager", False): (22, 8, 8, 0, 4, 8),
    ("eager", True): (20, 8, 8, 0, 4, 8),
    ("compiled", False): (6, 6, 8, 0, 4, 8),
    ("compiled", True): (2, 4, 8, 0, 4, 8),
    ("selective", False): (0, 2, 4, 2, 4, 0),
    ("selective", True): (8, 2, 4, 2, 4, 0),
}
# What QK-norm (Qwen3's) adds to them, bytes per element of the query and key heads and per head,
# by mode, counted the same way: eager, autocast's fp32 copy of each head and its normalized
# output (the norm runs decomposed: its fp32 weight does not match the bf16 input) and each
# head's rsqrt; compiled, the bf16 input and the rsqrt (Inductor recomputes the rest); under
# selective AC nothing (the policy recomputes the norms).
QK_NORM_SAVED = {"eager": (8, 4), "compiled": (2, 4), "selective": (0, 0)}
# What a block keeps on CUDA beyond (or short of) what it keeps on CPU, bytes a token per unit of
# dim, by (mode, float8). A compiled bf16 block keeps 8 more (two fp32 tensors of the residual
# stream, it seems: Inductor on CPU recomputes them); with the compiled loss's 3 units of logits
# (LOSS_UNITS), the two values that fit the H200's bf16 + compile rows of the 1B and the 3B
# (benchmarks/data/gpu_h200_suite.json). A float8 block does not: compiled, it keeps
# what the CPU count says; under selective AC, what the bf16 block keeps (the CPU count's 8 more
# are not there). Chosen from the H200's tied rows (the 1B grid's and the 3B's, in
# benchmarks/data/gpu_h200_grid_1b_tied.json: float8 + compile's allocated peak is bf16 +
# compile's less the CPU counts' difference, 11.37 GiB on the 3B, 4.81 on the 1B; selective AC's
# float8 and bf16 peaks equal to the MiB, eager and compiled); checked on the 8B grid's rows
# (gpu_h200_grid_8b.json), named before it was computed: its float8 + compile members' allocated
# peak within 3 % (+2 %; +7 % with the 8).
CUDA_EXTRA = {("compiled", False): 8, ("selective", True): -8}
# The loss at its peak, in units of the bf16 logits (tokens x vocab x 2 bytes): eager, the logits,
# their fp32 copy, log-softmax's saved fp32 output and its fp32 gradient (7; with it the H200's
# eager rows are their parts' sum within 1.2 %); compiled, 3 (inferred with CUDA_EXTRA).
LOSS_UNITS = {"eager": 7, "compiled": 3}
FOREACH_UPDATE = 4  # bytes a parameter: torch's foreach AdamW's fp32 temporary (the square root of
# the second moment, one list for all parameters: torch/optim/adam.py, _multi_tensor_adam); fused: 0


def autocast_replica(job: JobConfig) -> bool:
    """Whether a GPU rank of `job` is one replica under bf16 autocast that `autocast_peak` counts:
    a dense model, no FSDP, TP, PP or CP (DDP's replicas are), bf16 autocast on."""
    import torch

    from titan_exp.precision import autocast_dtype

    p = job.parallelism
    alone = (p.data_parallel_shard_degree * p.context_parallel_degree == 1 and p.tensor_parallel_degree == 1
             and p.pipeline_parallel_degree == 1)
    return alone and job.model.n_moe_layers == 0 and autocast_dtype(job.precision, False) == torch.bfloat16


def autocast_saved(job: JobConfig, mode: str, cuda: bool = True) -> float:
    """Bytes a token one block keeps for backward under bf16 autocast, `mode` eager, compiled or
    selective (AC per op): AUTOCAST_SAVED (and QK_NORM_SAVED) as counted on CPU, with CUDA_EXTRA on
    CUDA."""
    m = job.model
    key = (mode, job.precision.converter != "none")
    d, f, q, kv, h, c = AUTOCAST_SAVED[key]
    d += CUDA_EXTRA.get(key, 0) if cuda else 0
    heads = q * m.n_heads * m.head_size + kv * m.kv_heads * m.head_size + h * m.n_heads
    if m.qk_norm:
        per_element, per_head = QK_NORM_SAVED[mode]
        heads += (m.n_heads + m.kv_heads) * (per_element * m.head_size + per_head)
    return d * m.dim + f * m.ffn_hidden_dim + heads + c


def autocast_peak(job: JobConfig, architecture: str) -> dict[str, float]:
    """Peak bytes of one replica under bf16 autocast, by part, at the largest of its three moments
    (the module docstring): the states, autocast's weight copies, activations, checkpoints (full
    AC's fp32 block inputs), the loss (`logits`), float8's copies, the update's temporaries; beside
    them DDP's buckets (`fsdp_working_set`, as perf.model.memory names the working set), the caching
    allocator's rounding, cuBLAS's workspaces and NCCL's buffers (`nccl`)."""
    from titan_exp.train import muon
    from titan_exp.train.optim import kernels

    m, t, p, ac = job.model, job.training, job.parallelism, job.activation_checkpoint
    tokens = t.local_batch_size * t.seq_len
    microbatches = t.global_batch_size // (t.local_batch_size * p.data_parallel_replicate_degree)
    float8 = job.precision.converter != "none"
    mode = "compiled" if job.compile.enable else "eager"
    # autocast's copies of the block's linears; under a converter, of those it leaves (the rest cast their own weights)
    low = low_precision_linears(job)
    linears = m.n_layers * (sum(k * n for name, (k, n) in block_linears(m).items() if name not in low) if float8
                            else m.block_params - 2 * m.dim)
    copies = 2 * (m.vocab_size * m.dim + (0 if job.compile.enable else linears))
    buckets = 4 * m.num_params if p.data_parallel_replicate_degree > 1 else 0.0  # DDP: a second copy of the grads
    whole, inputs = autocast_saved(job, mode) * tokens, 4 * m.dim * tokens  # a block's saves; its fp32 input
    checkpoints = 0.0
    if ac.mode == ACMode.none:
        activations = m.n_layers * whole
    elif ac.mode == ACMode.full:
        activations, checkpoints = whole, m.n_layers * inputs  # one block recomputed at a time
    elif ac.selective_ac_option == "op":
        activations = m.n_layers * autocast_saved(job, "selective") * tokens
    else:  # every Nth block fully checkpointed, the others keep everything
        kept = m.n_layers // int(ac.selective_ac_option)
        activations, checkpoints = (m.n_layers - kept) * whole, kept * inputs
    f8 = float8_tensors(job, tokens)
    foreach = kernels(job.optimizer.implementation, on_gpu=True)["foreach"]
    # optimizer=muon: the blocks' matrices keep one moment (Muon's momentum), not AdamW's two
    matrices = m.n_layers * (m.block_params - muon.block_norm_params(m)) if muon.routes(job.optimizer._target_) else 0
    start = {"states": (12 if microbatches == 1 else 16) * m.num_params - 4 * matrices, "weight_copies": copies,
             "activations": activations, "checkpoints": checkpoints,
             "logits": LOSS_UNITS[mode] * tokens * m.vocab_size * 2, "float8": sum(b * k for b, k in f8)}
    end = {"states": 16 * m.num_params - 4 * matrices}
    update = {"states": 16 * m.num_params - 4 * matrices,
              "optimizer_step": FOREACH_UPDATE * (m.num_params - matrices) * foreach}
    peak = max((start, end, update), key=lambda parts: sum(parts.values()))
    saved = peak.get("activations", 0.0) * m.dim / (m.dim + m.ffn_hidden_dim)  # in tensors of dim, and of f
    tensors = step_tensors(job, tokens=tokens, act_bytes=2, gathered=2, working=buckets, fsdp=False,
                           saved=(saved, peak.get("activations", 0.0) - saved),
                           checkpoints=peak.get("checkpoints", 0.0), logits=peak is start,
                           float8=f8 if peak is start else [])
    return {**peak, "fsdp_working_set": buckets, "rounding": rounding(tensors), "workspaces": workspaces(architecture),
            "nccl": nccl(job)}
