"""The memory model: predicted peak memory of the most loaded rank, by part (GiB).

  * states: parameters, gradients and AdamW's two moments (fp32, 16 bytes per parameter; the
    param/grad share is smaller under bf16 params) of the rank's pipeline stages, divided by the
    shard degree (dp_shard x cp, times tp);
  * FSDP working set: the all-gathered parameters and unreduced gradients of about two blocks
    (all of the stage's parameters when they stay gathered: reshard_after_forward=never, or
    default under PP); DDP's gradient buckets, a second copy of the gradients;
  * activations: what each block keeps for backward (ACT_PER_TOKEN_D x dim + ACT_PER_TOKEN_H x
    the SwiGLU width, per token) for the blocks and microbatches alive at once: every block (AC
    none), block inputs plus one block (full), or between (selective); pipeline schedules keep
    several microbatches in flight; TP with sequence parallel divides it by tp;
  * logits and their gradient on the last stage (divided by tp under loss parallel);
  * a fixed runtime overhead per process (RUNTIME_GIB_CPU: the interpreter, torch, gloo, the
    data pipeline), which on a CPU is most of a small model's footprint. On CUDA it is 0, because
    peak memory there is torch's allocator peak.
The constants were fitted once on this project's CPU machine (BENCHMARKS.md records predicted
vs measured peak memory per layout).

MoE models: the routed experts and router run whole on every TP rank, so their states are
divided by dp_shard x cp only (under EP too: ep x efsdp is that product), their activations are
those of top_k experts per token plus the dispatched copies of the tokens (DISPATCH_COPIES), not
divided by tp; FSDP gathers 1/ep of the routed experts under EP.
"""

from __future__ import annotations

from titan_exp.config import ACMode, JobConfig
from titan_exp.parallel.pipeline import rank_loads
from titan_exp.validation import resolve

RUNTIME_GIB_CPU = 0.50
ACT_PER_TOKEN_D = 12  # floats per token per block, in units of dim
ACT_PER_TOKEN_H = 4  # ... in units of the SwiGLU hidden width
SELECTIVE_SHARE = 0.55  # the share of a block's activations per-op selective AC keeps
DISPATCH_COPIES = 4  # routed tokens (x top_k) alive per MoE layer: sorted, received, expert output, returned


def predict_memory(job: JobConfig, *, cuda: bool = False, pp_rank: int | None = None) -> dict[str, float]:
    """Predicted peak memory (GiB) of the most loaded rank (or of the ranks at pipeline position
    `pp_rank`), by part, and the total."""
    if job.parallelism.data_parallel_shard_degree == -1:
        job = resolve(job)
    p, t, m = job.parallelism, job.training, job.model
    pp, dps, cp, tp = (p.pipeline_parallel_degree, p.data_parallel_shard_degree, p.context_parallel_degree,
                       p.tensor_parallel_degree)
    if pp_rank is None and pp > 1:  # the pipeline position whose total is largest (first: embedding, last: logits)
        return max((predict_memory(job, cuda=cuda, pp_rank=k) for k in range(pp)), key=lambda parts: parts["total"])
    block = m.block_params
    routed = m.routed_params_per_block  # 0 for a dense model; not split by tp
    ep = p.expert_parallel_degree
    loads = rank_loads(p, m.n_layers)
    per_rank = loads[0].stages
    worst = loads[pp_rank or 0]
    params = worst.blocks * block + worst.first * m.embedding_params + worst.last * m.output_params
    shard = dps * cp * tp
    bytes_param = 2 if job.precision.full_bf16 else 4
    local_params = (params - worst.blocks * routed) / shard + worst.blocks * routed / (dps * cp)
    states = local_params * (2 * bytes_param + 8)
    # What one TP rank gathers of a block and of its stage: the dense part, and its routed experts.
    params = (params - worst.blocks * routed) / tp + worst.blocks * routed / ep
    block = (block - routed) / tp + routed / ep
    # On a GPU under bf16 mixed precision FSDP gathers bf16 parameters and autocast saves bf16
    # activations (2 bytes); the CPU constants below were fitted on this project's CPU runs as
    # they are (4), and stay so.
    low = job.precision.full_bf16 or (cuda and job.precision.param_dtype == "bfloat16")
    gathered = act_bytes = 2 if low else 4
    fsdp = dps * cp > 1
    keeps_gathered = p.fsdp_reshard_after_forward == "never" or (p.fsdp_reshard_after_forward == "default" and pp > 1)
    if fsdp and pp > 1 and cuda:
        # torch's pipeline schedules gather a stage's parameters once and reduce-scatter its
        # gradients once per step: the unsharded gradients accumulate over the microbatches
        # (fp32, the reduce dtype) beside the gathered parameters.
        working = params * (gathered + 4) + block * gathered
    elif fsdp and keeps_gathered:  # the stage's parameters stay gathered from forward to backward
        working = (params + block) * gathered
    elif fsdp:
        working = 3 * block * gathered
    elif p.data_parallel_replicate_degree > 1:  # DDP's gradient buckets: a second copy of the grads
        working = params * 4
    else:
        working = 0.0
    # Activations of one microbatch per block, and how many (block, microbatch) pairs live at once.
    microbatch = p.pipeline_parallel_microbatch_size if pp > 1 else t.local_batch_size
    tokens = microbatch * t.seq_len / cp
    moe_share = m.n_moe_layers / m.n_layers
    ffn_width = (1 - moe_share) * m.ffn_hidden_dim + moe_share * m.n_shared_experts * m.expert_hidden_dim
    per_block = tokens * (ACT_PER_TOKEN_D * m.dim + ACT_PER_TOKEN_H * ffn_width) * act_bytes / tp
    # Routed experts, whole on every TP rank: top_k experts' SwiGLU per token, and the token copies.
    per_block += moe_share * tokens * m.top_k * (ACT_PER_TOKEN_H * m.expert_hidden_dim + DISPATCH_COPIES * m.dim) * act_bytes
    inputs = tokens * m.dim * act_bytes / tp
    mode = job.activation_checkpoint.mode
    blocks = worst.blocks
    if mode == ACMode.none:
        activations = blocks * per_block
    elif mode == ACMode.full:
        activations = blocks * inputs + per_block
    elif job.activation_checkpoint.selective_ac_option == "op":
        activations = blocks * per_block * SELECTIVE_SHARE
    else:
        every = int(job.activation_checkpoint.selective_ac_option)
        kept = blocks // every
        activations = (blocks - kept) * per_block + kept * inputs + per_block
    if pp > 1:
        n_mb = t.local_batch_size // microbatch
        in_flight = n_mb if p.pipeline_parallel_schedule == "GPipe" else min(n_mb, pp * per_rank)
        activations *= in_flight / per_rank if per_rank > 1 else in_flight
    # The logits, their fp32 copy for the loss and its gradient (bf16 logits on a GPU: 2 + 4 + 4 bytes).
    logits = tokens * m.vocab_size * (act_bytes + 8) / tp if worst.last else 0.0
    gib = 2**30
    parts = {
        "states": states / gib,
        "fsdp_working_set": working / gib,
        "activations": activations / gib,
        "logits": logits / gib,
        "runtime": 0.0 if cuda else RUNTIME_GIB_CPU,
    }
    parts["total"] = sum(parts.values())
    return parts
