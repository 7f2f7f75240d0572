"""What the cost models count a model in: the TP degrees its block splits into, a block's weight
tensors on one TP rank, and how often FSDP gathers and reduces a unit per step."""

from __future__ import annotations

from titan_exp.config import JobConfig, ModelConfig

Sizes = list[tuple[float, float]]  # (bytes or elements, how many)


def fsdp_rounds(job: JobConfig, accumulation: int) -> tuple[int, int]:
    """(all-gather / reduce-scatter rounds per step, all-gathers per round) of an FSDP unit."""
    mode = job.parallelism.fsdp_reshard_after_forward
    per_step = job.parallelism.pipeline_parallel_degree > 1 and mode == "default"  # PP stages keep parameters gathered
    return (1 if per_step else accumulation), (1 if per_step or mode == "never" else 2)


def block_tensors(job: JobConfig) -> Sizes:
    """The mean block's weights on one TP rank, as (elements, how many per block): q, k, v, o and
    the SwiGLU's three; in an MoE model's MoE layers (their share of the blocks) the routed experts'
    three stacked weights (1/ep of the experts, whole over TP) and the shared experts'."""
    m, p = job.model, job.parallelism
    tp, ep = p.tensor_parallel_degree, p.expert_parallel_degree
    q, kv = m.dim * m.n_heads * m.head_size / tp, m.dim * m.kv_heads * m.head_size / tp
    moe = m.n_moe_layers / m.n_layers
    out = [(q, 2.0), (kv, 2.0), (m.dim * m.ffn_hidden_dim / tp, 3 * (1 - moe))]
    if moe:
        out += [(m.n_experts / ep * m.dim * m.expert_hidden_dim, 3 * moe)]
        if m.n_shared_experts:
            out += [(m.n_shared_experts * m.dim * m.expert_hidden_dim / tp, 3 * moe)]
    return out


def tp_degrees(m: ModelConfig, world: int) -> list[int]:
    """The TP degrees `world` ranks can split this model's block into (heads and SwiGLU width)."""
    return [tp for tp in range(1, world + 1)
            if world % tp == 0 and m.n_heads % tp == 0 and m.kv_heads % tp == 0 and m.ffn_hidden_dim % tp == 0]
