"""The memory model: predicted peak memory of the most loaded rank, by part (GiB).

  * states: parameters, gradients and AdamW's two moments (fp32, 16 bytes per parameter; the
    param/grad share is smaller under bf16 params; optimizer=muon keeps one moment of the blocks'
    matrices, 12) of the rank's pipeline stages, divided by the shard degree (dp_shard x cp, times tp);
  * FSDP working set: at the backward of the unit where it is largest (a block, the embedding or
    the output layer), the unit's all-gathered parameters and unreduced gradient, the next unit,
    prefetched, and the previous unit's reduce-scatter input, which FSDP holds until the next
    reduce-scatter (_unit_peak; all of the stage's parameters when they stay gathered:
    reshard_after_forward=never, or default under PP; with their unsharded fp32 gradients where
    a pipeline accumulates them over several microbatches; float8 linears a byte an element under
    float8 all-gather); under TP at least the embedding's whole gradient, which DTensor computes
    on every rank; DDP's gradient buckets, a second copy of the gradients;
  * activations: what each block keeps for backward (ACT_PER_TOKEN_D x dim + ACT_PER_TOKEN_H x
    the SwiGLU width, per token; and what MLA's latents, heads whose width together is not dim
    and QK-norm keep beside: latent_attention_saved, wide_attention_saved) for the blocks and
    microbatches alive at once: every block (AC
    none), what the per-op policy keeps, counted (selective per op: selective_saved), or, under
    AC, the one block being recomputed;
    TP with sequence parallel divides it by tp, except the gathered inputs (SP_GATHERED);
  * checkpoints: the block inputs activation checkpointing keeps instead (full, or every Nth
    block); pipeline schedules keep several microbatches' of these and of the activations in
    flight, but recompute one block at a time;
  * the loss's tensors on the last stage (divided by tp under loss parallel): the logits, their
    fp32 copy and gradient, fewer where the trainer compiles the loss on a GPU; and under TP the
    output projection's gathered input;
  * a fixed runtime overhead per process (RUNTIME_GIB_CPU: the interpreter, torch, gloo, the
    data pipeline), which on a CPU is most of a small model's footprint. On CUDA it is 0, because
    peak memory there is what torch's caching allocator reserved;
  * on a GPU, the parts perf.model.memory_gpu prices from PyTorch's, torchao's and NCCL's sources: the
    caching allocator's rounding of the tensors a step allocates (512-byte blocks, 2 and 20 MiB
    segments, large requests rounded up to 2 MiB), cuBLAS's workspaces (once per process),
    float8's transient copies and scales; and NCCL's buffers, which NCCL allocates outside
    torch's allocator: reported (`nccl`), not in the total, which is the allocator's reserved
    peak TorchTitan reports and a job's memory is checked against. Beyond the rounded tensors the
    allocator reserves next to nothing with expandable segments (cluster.cuda_expandable_segments,
    the default here and TorchTitan's launcher's): not priced. The activations are the account
    above in the GPU's bytes (compiled blocks taken to keep what eager ones keep), the loss the
    units an H200 counted (memory_gpu.LOSS_UNITS): nothing is fitted on published rows;
  * on a GPU, one replica under bf16 autocast (no FSDP, TP, PP or CP; a dense model: a single GPU,
    or DDP) is counted instead, part by part at the moments its peak can be, with nothing fitted
    on TorchTitan's rows (perf.model.memory_gpu.autocast_peak): its fp32 parameters, autocast's bf16
    weight copies, what this toolkit's block saves, counted;
  * the allocator's slack on a CPU: glibc's heap holds freed FSDP per-block buffers that are under
    the mmap threshold, and under TP each block's freed sequence-sharded outputs; a CPU's measured
    peak is the resident set, which counts them (perf.model.memory_cpu, which only CPU plans read).
The CPU constants were fitted once on this project's CPU machine (BENCHMARKS.md records predicted
vs measured peak memory per layout).

MoE models: without EP each TP rank holds 1/tp of every routed expert's width (parallel.tensor),
so their states are divided by dp_shard x cp x tp (the router's by dp_shard x cp: it runs whole on
every TP rank), and every TP rank dispatches every token: the dispatched copies of the tokens
(DISPATCH_COPIES) are not divided by tp, the experts' hidden activations are. Under EP, which
spreads over TP's ranks too (parallel.expert), ep x efsdp = dp_shard x cp x tp ranks shard the
routed experts, and each TP rank dispatches 1/tp of the tokens through whole experts. FSDP gathers
1/ep of the routed experts under EP.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_exp.config import ACMode, JobConfig, ModelConfig
from titan_exp.parallel import compiles_loss
from titan_exp.parallel.pipeline import RankLoad, rank_loads
from titan_exp.perf.model.engine import TITAN_EXP, Engine
from titan_exp.perf.model.shapes import (
    FFN_LINEARS,
    ROUTER,
    SHARED_LINEARS,
    attention_on_rank,
    block_matmuls,
    float8_gathered,
    fsdp_rounds,
    mean_ffn_width,
    selective_saves,
)
from titan_exp.train import muon
from titan_exp.validation import resolved

RUNTIME_GIB_CPU = 0.50
ACT_PER_TOKEN_D = 12  # floats per token per block, in units of dim
ACT_PER_TOKEN_H = 4  # ... in units of the SwiGLU hidden width
ATTENTION_PER_TOKEN_D = 5  # of ACT_PER_TOKEN_D: q, k, v, attention's output and wo's input, at Llama's width
SP_GATHERED = 2  # of ACT_PER_TOKEN_D: the sequence-parallel inputs each block gathers and saves whole
DISPATCH_COPIES = 3  # routed tokens (x top_k) a block saves per MoE layer, counted on CPU with or without EP
EXCHANGED_COPIES = 2  # routed tokens (x top_k) EP's all-to-alls return (received, returned): selective AC saves them
ATTENTION_WIDTH_SAVES = 4  # tensors attention saves at the query heads' width (wide_attention_saved)
# Bytes a token per unit of dim a block in bf16 (FSDP's mixed precision, or full_bf16) keeps beyond
# ACT_PER_TOKEN_D's count, which was fitted in fp32: its RMSNorms' fp32 upcasts of their inputs,
# new tensors in bf16 (in fp32 the same). Counted with autograd's saved-tensor hooks on the block in
# bf16 at Llama 3 1B's shape, with its heads 128 wide and with a wider SwiGLU (to tell the
# terms of dim from those of the heads and the SwiGLU): 20 d + 8 q + 8 f bytes a token (q the query
# heads' width), of which this is what ACT_PER_TOKEN_* and wide_attention_saved leave
# (tests/planner/test_memory_fsdp_units.py recounts it).
BF16_UPCAST_D = 4


@dataclass(frozen=True)
class GpuMemory:
    """What a GPU's memory account reads of the device: its architecture, which picks cuBLAS's
    workspace size (perf.model.memory_gpu.workspaces)."""

    architecture: str = "hopper"  # hopper, ampere or blackwell (perf.rates.devices.DeviceSpec.architecture)


ALLOCATOR_SLACK = ("runtime", "allocator", "rounding", "workspaces")  # in the total, not in live tensors
OUTSIDE_ALLOCATOR = ("nccl",)  # predicted, not in the total: not in torch's reserved peak


def tensor_gib(parts: dict[str, float]) -> float:
    """What a predicted peak holds in live tensors: its total less the process's own runtime
    (CPU), the allocator's slack (GPU: the caching allocator's rounding and fragmentation; CPU:
    glibc's heap) and cuBLAS's workspaces. The dry run measures this (its tensor peak)."""
    return parts["total"] - sum(parts[k] for k in ALLOCATOR_SLACK)


def latent_attention_saved(m: ModelConfig, tp: int) -> float:
    """What multi-head latent attention saves for backward a token on one TP rank beyond what
    ACT_PER_TOKEN_D counts for attention at Llama's widths (ATTENTION_PER_TOKEN_D x dim), in
    activation elements: its q and k (n_heads / tp heads of head_size), v, attention's output and
    wo's input (of v_head_size), and each latent's norm input and output (whole on every TP rank);
    0 without MLA. An assumption from the saves of the layer's code (titan_exp.models.mla), not
    fitted. On CPU in bf16, autograd's hooks count the tiny DeepSeek-V3 block's saves beyond the
    debug Llama block's (at one shape, both 256 wide) within 1 % of this, once its norms'
    decomposed fp32 saves (6 bytes an element more than CUDA's fused norm) are added."""
    if not m.mla:
        return 0.0
    heads = m.n_heads / tp
    return (2 * heads * m.head_size + 3 * heads * m.v_head_size - ATTENTION_PER_TOKEN_D * m.dim / tp
            + 2 * (m.q_lora_rank + m.kv_lora_rank))


def wide_attention_saved(m: ModelConfig, tp: int, cuda: bool) -> float:
    """What grouped-query attention saves for backward a token on one TP rank beyond what
    ACT_PER_TOKEN_D counts for it at Llama's widths, in activation elements: where the query heads
    are not dim wide together (Qwen3's heads are 128 wide at any dim), ATTENTION_WIDTH_SAVES tensors
    of their width, less dim (the rotated queries, the keys and values repeated to every head,
    attention's output, of which wo's input is a view); and QK-norm's saves over the query and key
    heads: its input, on a CPU also its normalized output (a CUDA torch's fused kernel keeps the
    input alone), and each head's rsqrt (one element: fp32's bytes in fp32, half of them in bf16,
    beside a head of 128). 0 at Llama's shapes and under MLA
    (latent_attention_saved). On CPU in fp32, autograd's hooks count the block's saves beyond the
    debug Llama block's (16 heads of 16) to the element with 16 heads of 8 and 32, with and without
    QK-norm (attention's fp32 log-sum-exp, a float a head, is left out: it moves with the head count)."""
    if m.mla:
        return 0.0
    heads = m.n_heads / tp
    wider = ATTENTION_WIDTH_SAVES * (heads * m.head_size - m.dim / tp)
    if not m.qk_norm:
        return wider
    normed = heads + m.kv_heads / tp
    return wider + normed * ((1 if cuda else 2) * m.head_size + 1)


def selective_saved(job: JobConfig, moe: bool, cuda: bool, act_bytes: int) -> float:
    """Bytes a token (of the sequence a TP rank sees) one block keeps under per-op selective AC, as
    titan_exp.parallel.activation_checkpoint's policy keeps them, counted, not fitted: the block's
    input (the checkpoint's; sequence-sharded under TP), the outputs of the matmuls it saves
    (perf.model.shapes.block_matmuls, selective_saves: an MoE layer's router's in fp32; its routed
    experts' only where they run one expert at a time, on a CPU; a row-wise TP linear's output is
    its whole partial sum), attention's output and fp32 log-sum-exp, TP's reduce-scatters' outputs
    and EP's exchanged tokens (EXCHANGED_COPIES). The routed experts' tokens are taken as balanced.
    On CPU the policy's saves of the debug Llama and MoE blocks are these bytes
    (tests/test_one_rank.py counts them)."""
    m, p = job.model, job.parallelism
    tp, ep = p.tensor_parallel_degree, (p.expert_parallel_degree if moe else 1)
    # Each matmul's output: (elements a token, bytes each)
    outputs = {name: (n, act_bytes) for name, (_, n) in attention_on_rank(m, tp).items()}
    local = m.n_experts // ep if moe and not cuda else 0
    exchanged = 0.0
    if moe:
        routed = m.top_k / p.dispatch_split  # routed rows a token of this rank's sequence
        outputs[ROUTER] = (m.n_experts, 4)  # fp32 logits, every token on every TP rank
        width = m.expert_hidden_dim / p.expert_width_split
        for i in range(local):
            outputs |= {f"moe.experts.{i}.{w}": (routed / local * n, act_bytes)
                        for w, n in (("w1", width), ("w3", width), ("w2", m.dim))}
        shared = m.n_shared_experts * m.expert_hidden_dim
        outputs |= dict(zip(SHARED_LINEARS, ((shared / tp, act_bytes), (shared / tp, act_bytes), (m.dim, act_bytes))))
        exchanged = routed * EXCHANGED_COPIES * m.dim * act_bytes if ep > 1 else 0.0
    else:
        outputs |= dict(zip(FFN_LINEARS, ((m.ffn_hidden_dim / tp, act_bytes), (m.ffn_hidden_dim / tp, act_bytes),
                                          (m.dim, act_bytes))))
    saves = selective_saves(block_matmuls(m, moe, local))
    kept = sum(n * b for name, (n, b) in outputs.items() if name in saves)
    heads = m.n_heads / tp
    attention = heads * m.v_head_size * act_bytes + heads * 4
    # Under EP an MoE layer hands back its own sequence shard (its shared experts all-reduced):
    # the attention's reduce-scatter is the block's one (parallel.tensor.moe_plan).
    reduce_scatters = (1 if ep > 1 else 2) * m.dim / tp * act_bytes if tp > 1 else 0.0
    return m.dim / tp * act_bytes + kept + attention + reduce_scatters + exchanged


@dataclass(frozen=True)
class _Rank:
    """What every part of a rank's memory reads: the job, its pipeline position's load, the bytes an
    activation and a gathered parameter take, how FSDP gathers, and one microbatch's tokens."""

    job: JobConfig
    cuda: bool
    worst: RankLoad  # the blocks and ends of the pipeline position priced
    stages: int  # stages a pipeline rank holds
    act_bytes: int  # also a gathered parameter's
    fsdp: bool
    keeps_gathered: bool  # one all-gather a round: gathered from forward to backward
    accumulates: bool  # a pipeline accumulates unsharded gradients over its microbatches
    n_mb: int
    tokens: float  # one microbatch's, on one rank

    @property
    def moe_share(self) -> float:
        return self.job.model.n_moe_layers / self.job.model.n_layers

    @property
    def ffn_width(self) -> float:
        return mean_ffn_width(self.job.model)


def _rank(job: JobConfig, cuda: bool, pp_rank: int) -> _Rank:
    p, t = job.parallelism, job.training
    loads = rank_loads(p, job.model.n_layers)
    # Under bf16 mixed precision FSDP gathers bf16 parameters and the blocks run and save in bf16 (2
    # bytes), on a CPU too (parallel.fsdp's MixedPrecisionPolicy); a GPU's autocast saves bf16 activations. A
    # CPU without FSDP autocasts (CPU autocast keeps much in fp32): the CPU constants below were fitted on
    # such runs as they are (4), and stay so.
    fsdp = p.data_parallel_shard_degree * p.context_parallel_degree > 1
    low = job.precision.full_bf16 or ((cuda or fsdp) and job.precision.param_dtype == "bfloat16")
    microbatch = p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else t.local_batch_size
    n_mb = t.local_batch_size // microbatch
    # torch's pipeline schedules gather a stage's parameters once and reduce-scatter its gradients
    # after the last microbatch: before it, the unsharded gradients accumulate (fp32, the reduce
    # dtype) beside the gathered parameters.
    accumulates = fsdp and p.pipeline_parallel_degree > 1 and n_mb > 1
    return _Rank(job, cuda, loads[pp_rank], loads[0].stages, 2 if low else 4, fsdp, fsdp_rounds(job, 1)[1] == 1,
                 accumulates, n_mb, microbatch * t.seq_len / p.context_parallel_degree)


def _states_and_gathered(r: _Rank) -> tuple[float, float, float]:
    """The rank's parameters, gradients and optimizer states as sharded (bytes); and what one TP rank
    gathers of its stage and of a block (parameters)."""
    job, worst = r.job, r.worst
    p, m = job.parallelism, job.model
    dps, cp, tp, ep = (p.data_parallel_shard_degree, p.context_parallel_degree, p.tensor_parallel_degree,
                       p.expert_parallel_degree)
    block = m.block_params
    routed = m.routed_params_per_block  # 0 for a dense model
    routed_rank = m.routed_params_on_tp_rank(tp, ep)  # of them, on one TP rank
    params = worst.blocks * block + worst.first * m.embedding_params + worst.last * m.output_params_on(worst.first)
    shard = dps * cp * tp
    bytes_param = 2 if job.precision.full_bf16 else 4
    # ep x efsdp ranks shard the routed experts under EP; without it FSDP's shard a TP rank's slice
    experts = routed / shard if ep > 1 else routed_rank / (dps * cp)
    local_params = (params - worst.blocks * routed) / shard + worst.blocks * experts
    states = local_params * (2 * bytes_param + 8)
    if muon.routes(job.optimizer._target_):  # Muon's one moment (4 bytes) of the blocks' matrices, not AdamW's two
        router = m.router_params_per_block / (shard if ep > 1 else dps * cp)  # in `experts`, but AdamW's
        states -= 4 * worst.blocks * ((block - routed - muon.block_norm_params(m)) / shard + experts - router)
    params = (params - worst.blocks * routed) / tp + worst.blocks * routed_rank
    block = (block - routed) / tp + routed_rank
    return states, params, block


def _reduce_bytes(job: JobConfig) -> int:
    """Bytes an element of a gradient FSDP reduce-scatters (precision.reduce_dtype)."""
    return 2 if job.precision.reduce_dtype == "bfloat16" else 4


def _block_tail(r: _Rank, block: float) -> float:
    """What of a block (`block` gathered parameters) FSDP reduce-scatters last in backward: under EP
    its routed experts are a unit of their own, reduced first, and the rest of the block after."""
    p, m = r.job.parallelism, r.job.model
    if p.expert_parallel_degree > 1 and m.routed_params_per_block:
        return block - m.routed_params_on_tp_rank(p.tensor_parallel_degree, p.expert_parallel_degree)
    return block


def _unit_peak(r: _Rank, block: float, logits: float, f8_less: float) -> float:
    """FSDP gathering one unit at a time: the largest of what each unit's backward holds, in the order
    backward reaches the units (the output layer, the blocks, the embedding): the unit's gathered
    parameters and their unsharded gradients, the next unit (prefetched), and the previous unit's
    reduce-scatter input (its whole gradient in the reduce dtype), which FSDP keeps until the next
    reduce-scatter is issued (torch's reduce_scatter_max_input_buffers, 1). The logits live at the
    output layer's backward only: the peak is taken with them there, less them (the loss part counts them).
    A block is one unit here, but for which of its parts is reduced last (_block_tail); `f8_less`: the
    bytes fewer a block arrives in under float8 all-gather."""
    job, m, worst, gathered = r.job, r.job.model, r.worst, r.act_bytes
    tp = job.parallelism.tensor_parallel_degree
    output, embedding = m.output_params_on(worst.first) / tp, m.embedding_params / tp
    # (parameters, gathered bytes fewer, parameters reduced last) of each unit, in backward's order
    units = [(output, 0.0, output)] * worst.last + [(block, f8_less, _block_tail(r, block))] * worst.blocks + [
        (embedding, 0.0, embedding)] * worst.first
    units = [unit for unit in units if unit[0]]
    moments = []
    for i, (n, less, _) in enumerate(units):
        previous = units[i - 1][2] * _reduce_bytes(job) if i else 0.0
        following = units[i + 1][0] * gathered - units[i + 1][1] if i + 1 < len(units) else 0.0
        moments.append(previous + 2 * n * gathered - less + following + (logits if i == 0 else 0.0))
    return max(moments, default=0.0) - (logits if units else 0.0)


def _working_set(r: _Rank, params: float, block: float, logits: float) -> float:
    """FSDP's gathered parameters and unreduced gradients at their peak (or DDP's buckets); under TP,
    at least the embedding's whole gradient."""
    p, m, gathered = r.job.parallelism, r.job.model, r.act_bytes
    # Under float8 all-gather a block's float8 linears arrive a byte an element (shapes.float8_gathered).
    f8_less = float8_gathered(r.job)[0] * (gathered - 1)  # bytes fewer in each gathered block
    if r.accumulates:  # and the fresh gradient of the unit at work, before autograd adds it in: the largest
        tp, worst = p.tensor_parallel_degree, r.worst
        largest = max(block, worst.first * m.embedding_params / tp, worst.last * m.output_params_on(worst.first) / tp)
        working = params * (gathered + 4) + largest * gathered - (r.worst.blocks + (largest == block)) * f8_less
    elif r.fsdp and r.keeps_gathered:  # the stage's parameters stay gathered from forward to backward
        working = (params + block) * gathered - (r.worst.blocks + 1) * f8_less
    elif r.fsdp:
        working = _unit_peak(r, block, logits if r.worst.last else 0.0, f8_less)
    elif p.data_parallel_replicate_degree > 1:  # DDP's gradient buckets: a second copy of the grads
        working = params * 4
    else:
        working = 0.0
    if p.tensor_parallel_degree > 1 and r.worst.first:
        # torch's DTensor has no vocabulary-sharded embedding backward: under TP every rank
        # computes the embedding's whole gradient (vocab x dim) and then keeps its shard. With
        # its gathered weight and that shard, it is the working set's peak when the vocabulary
        # is large; twice, where the pipeline accumulates gradients unsharded. Beside them, where FSDP
        # reduce-scatters a unit at a time, the block before it in backward's reduce-scatter input (_unit_peak).
        whole = m.embedding_params * gathered
        reduced = r.fsdp and not r.accumulates and r.worst.blocks
        pending = _block_tail(r, block) * _reduce_bytes(r.job) if reduced else 0.0
        working = max(working, (2 if r.accumulates else 1) * whole + 2 * whole / p.tensor_parallel_degree + pending)
    return working


def _block_activations(r: _Rank) -> float:
    """Bytes one block saves for backward of one microbatch (ACT_PER_TOKEN_*: fitted constants)."""
    p, m, tokens, act_bytes = r.job.parallelism, r.job.model, r.tokens, r.act_bytes
    tp = p.tensor_parallel_degree
    per_block = tokens * (ACT_PER_TOKEN_D * m.dim + ACT_PER_TOKEN_H * r.ffn_width) * act_bytes / tp
    if act_bytes == 2 and not m.mla:  # the norms' fp32 upcasts (BF16_UPCAST_D)
        per_block += tokens * BF16_UPCAST_D * m.dim / tp
    per_block += tokens * (latent_attention_saved(m, tp) + wide_attention_saved(m, tp, r.cuda)) * act_bytes
    # Sequence parallel: the attention's and the feed-forward's inputs are all-gathered to the
    # whole sequence, and their first linears save that gathered copy for backward (2 of the
    # ACT_PER_TOKEN_D), so those two are not divided by tp.
    per_block += SP_GATHERED * tokens * m.dim * act_bytes * (1 - 1 / tp)
    # Routed experts: top_k experts' SwiGLU per token (a TP rank's slice of its width without EP),
    # and the token copies; of every token on each TP rank without EP, of its sequence shard's under EP.
    dispatched = tokens / p.dispatch_split
    per_routed_row = ACT_PER_TOKEN_H * m.expert_hidden_dim / p.expert_width_split + DISPATCH_COPIES * m.dim
    per_block += r.moe_share * dispatched * m.top_k * per_routed_row * act_bytes
    return per_block


def _kept(r: _Rank, per_block: float) -> tuple[float, float, float]:
    """What the blocks keep for backward, in two parts: `saved`, the tensors the blocks save inside
    (per-op selective AC's counted), and `checkpoints`, the block inputs activation checkpointing
    keeps in their place (exact bytes); and `recompute`, the one block being recomputed in backward
    under AC: it lives once, whatever the pipeline has in flight."""
    job, blocks = r.job, r.worst.blocks
    p, mode = job.parallelism, job.activation_checkpoint.mode
    inputs = r.tokens * job.model.dim * r.act_bytes / p.tensor_parallel_degree
    recompute = 0.0 if mode == ACMode.none else per_block
    if mode == ACMode.none:
        saved, checkpoints = blocks * per_block, 0.0
    elif mode == ACMode.full:
        saved, checkpoints = 0.0, blocks * inputs
    elif job.activation_checkpoint.selective_ac_option == "op":
        per_token = sum(share * selective_saved(job, moe, r.cuda, r.act_bytes)
                        for moe, share in ((True, r.moe_share), (False, 1 - r.moe_share)) if share)
        saved, checkpoints, recompute = blocks * r.tokens * per_token, 0.0, 0.0
    else:
        kept = blocks // int(job.activation_checkpoint.selective_ac_option)
        saved, checkpoints = (blocks - kept) * per_block, kept * inputs
    if p.pipeline_parallel_degree > 1:  # the schedule keeps several microbatches' activations alive at once
        gpipe = p.pipeline_parallel_schedule == "GPipe"
        in_flight = r.n_mb if gpipe else min(r.n_mb, p.pipeline_parallel_degree * r.stages)
        alive = in_flight / r.stages if r.stages > 1 else in_flight
        saved, checkpoints = saved * alive, checkpoints * alive
    return saved, checkpoints, recompute


def _logits(r: _Rank, engine: Engine) -> float:
    """The loss at its peak, split by tp under loss parallel. On a GPU with bf16 logits, the units
    of them an H200 counted (perf.model.memory_gpu.LOSS_UNITS): eager (TorchTitan's loss is this
    toolkit's code, eager there under compile too), the logits, their fp32 copy, log-softmax's saved
    fp32 output and its fp32 gradient; compiled (parallel.compiles_loss: with the blocks, not under
    loss parallel), the saved logits and their fp32 gradient. Else the logits, their fp32 copy and
    its gradient (a compiled loss: the logits and the gradient)."""
    if not r.worst.last:
        return 0.0
    p, m, tp = r.job.parallelism, r.job.model, r.job.parallelism.tensor_parallel_degree
    vocab_split = 1 if p.disable_loss_parallel else tp
    compiled = r.cuda and (compiles_loss(r.job) if engine.loss_compiled is None else engine.loss_compiled)
    if r.cuda and r.act_bytes == 2:
        from titan_exp.perf.model.memory_gpu import LOSS_UNITS  # only a GPU's terms read it

        loss_bytes = LOSS_UNITS["compiled" if compiled else "eager"] * 2
    else:
        loss_bytes = r.act_bytes + (4 if compiled else 8)
    return r.tokens * m.vocab_size * loss_bytes / vocab_split + r.tokens * m.dim * r.act_bytes * (tp > 1)


def _gpu_parts(r: _Rank, gpu: GpuMemory, parts: dict[str, float]) -> dict[str, float]:
    """A GPU's terms: float8's copies, the caching allocator's rounding, cuBLAS's workspaces (by
    `gpu`'s architecture), NCCL's buffers (perf.model.memory_gpu)."""
    from titan_exp.perf.model import memory_gpu  # only a GPU's terms read it

    job, m = r.job, r.job.model
    activations = parts["activations"]
    f8 = memory_gpu.float8_tensors(job, r.tokens)
    float8 = sum(b * k for b, k in f8)
    d_share = ACT_PER_TOKEN_D * m.dim / (ACT_PER_TOKEN_D * m.dim + ACT_PER_TOKEN_H * r.ffn_width)
    rounding = memory_gpu.rounding(memory_gpu.step_tensors(
        job, tokens=r.tokens, act_bytes=r.act_bytes, gathered=r.act_bytes, working=parts["fsdp_working_set"],
        fsdp=r.fsdp, saved=(activations * d_share, activations * (1 - d_share)), checkpoints=parts["checkpoints"],
        logits=bool(r.worst.last), float8=f8))
    return parts | {"float8": float8, "rounding": rounding,
                    "workspaces": memory_gpu.workspaces(gpu.architecture), "nccl": memory_gpu.nccl(job)}


def _cpu_slack(r: _Rank) -> float:
    """glibc's heap (little at a 1 MiB threshold: mapped and unmapped instead)."""
    from titan_exp.perf.model import memory_cpu  # only a CPU's terms read it

    per_block_fsdp = r.fsdp and not r.keeps_gathered and not r.accumulates
    slack = memory_cpu.heap_slack(r.job, r.worst.blocks) if per_block_fsdp else 0.0
    return slack + memory_cpu.sp_heap_slack(r.job, r.worst.blocks, r.tokens, r.act_bytes)


def predict_memory(job: JobConfig, *, cuda: bool = False, pp_rank: int | None = None,
                   gpu: GpuMemory = GpuMemory(), engine: Engine = TITAN_EXP) -> dict[str, float]:
    """Predicted peak memory (GiB) of the most loaded rank (or of the ranks at pipeline position
    `pp_rank`), by part, and the total. On a GPU (`cuda`) the caching allocator's rounding,
    cuBLAS's workspaces (by `gpu`'s architecture) and float8's copies are parts of their own
    (perf.model.memory_gpu); NCCL's buffers
    (`nccl`) are predicted beside the total, not in it (OUTSIDE_ALLOCATOR). `engine` says whether
    the loss runs compiled (model.engine: by default as this toolkit's trainer runs it)."""
    job = resolved(job)
    if cuda:
        from titan_exp.perf.model import memory_gpu

        if memory_gpu.autocast_replica(job):  # counted part by part, nothing fitted here
            return _in_gib(memory_gpu.autocast_peak(job, gpu.architecture))
    pp = job.parallelism.pipeline_parallel_degree
    if pp_rank is None and pp > 1:  # the pipeline position whose total is largest (first: embedding, last: logits)
        return max((predict_memory(job, cuda=cuda, pp_rank=k, gpu=gpu, engine=engine) for k in range(pp)),
                   key=lambda parts: parts["total"])
    r = _rank(job, cuda, pp_rank or 0)
    states, params, block = _states_and_gathered(r)
    saved, checkpoints, recompute = _kept(r, _block_activations(r))
    logits = _logits(r, engine)
    parts = {"states": states, "fsdp_working_set": _working_set(r, params, block, logits),
             "activations": saved + recompute, "checkpoints": checkpoints, "logits": logits}
    if cuda:
        return _in_gib(_gpu_parts(r, gpu, parts))
    return _in_gib(parts | {"allocator": _cpu_slack(r)}, runtime_gib=RUNTIME_GIB_CPU)


PARTS = ("states", "fsdp_working_set", "weight_copies", "activations", "checkpoints", "logits", "float8",
         "optimizer_step", "rounding", "allocator", "workspaces")


def _in_gib(parts: dict[str, float], runtime_gib: float = 0.0) -> dict[str, float]:
    """Bytes by part as GiB, every part of PARTS (0 where absent), the runtime, their total, and
    NCCL's buffers beside it (OUTSIDE_ALLOCATOR)."""
    out = {k: parts.get(k, 0.0) / 2**30 for k in PARTS} | {"runtime": runtime_gib}
    out["total"] = sum(out.values())
    out["nccl"] = parts.get("nccl", 0.0) / 2**30
    return out
