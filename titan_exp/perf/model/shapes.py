"""What the cost models count a model in: the TP degrees its block splits into, a block's weight
tensors on one TP rank, how often FSDP gathers and reduces a unit per step, and what of a block
it gathers in float8."""

from __future__ import annotations

from titan_exp.config import JobConfig, ModelConfig
from titan_exp.precision import converts

Sizes = list[tuple[float, float]]  # (bytes or elements, how many)
Matrices = list[tuple[int, int, float]]  # (rows, cols, how many)


def fsdp_rounds(job: JobConfig, accumulation: int) -> tuple[int, int]:
    """(all-gather / reduce-scatter rounds per step, all-gathers per round) of an FSDP unit."""
    mode = job.parallelism.fsdp_reshard_after_forward
    per_step = job.parallelism.pipeline_parallel_degree > 1 and mode == "default"  # PP stages keep parameters gathered
    return (1 if per_step else accumulation), (1 if per_step or mode == "never" else 2)


# A block's SwiGLU's linears by name (titan_exp.models.llama): the attention's come before them
# (attention_linears). An MoE layer's shared experts are taken to be converted as the dense
# SwiGLU's are, where their names differ (an assumption).
FFN_LINEARS = ("feed_forward.w1", "feed_forward.w3", "feed_forward.w2")


def attention_linears(m: ModelConfig) -> dict[str, tuple[int, int, str]]:
    """The attention's linears by name, in the order its forward runs them, with their whole shapes
    (in, out) and how TP splits each: "out", column-wise by heads; "in", row-wise (wo); "whole", on
    every TP rank (multi-head latent attention's down-projections to its latents:
    parallel.tensor.attention_plan). Llama's q, k, v, o; MLA's (titan_exp.models.mla) wq (or
    wq_a and wq_b through the query latent), wkv_a, wkv_b and wo."""
    h, qk = m.n_heads, m.head_size
    if not m.mla:
        kv = m.kv_heads * qk
        return {"attention.wq": (m.dim, h * qk, "out"), "attention.wk": (m.dim, kv, "out"),
                "attention.wv": (m.dim, kv, "out"), "attention.wo": (h * qk, m.dim, "in")}
    queries = ({"attention.wq_a": (m.dim, m.q_lora_rank, "whole"), "attention.wq_b": (m.q_lora_rank, h * qk, "out")}
               if m.q_lora_rank else {"attention.wq": (m.dim, h * qk, "out")})
    return queries | {"attention.wkv_a": (m.dim, m.kv_lora_rank + m.rope_dim, "whole"),
                      "attention.wkv_b": (m.kv_lora_rank, h * (m.head_size - m.rope_dim + m.v_head_size), "out"),
                      "attention.wo": (h * m.v_head_size, m.dim, "in")}


def mean_ffn_width(m: ModelConfig) -> float:
    """The SwiGLU's width averaged over the blocks: the dense blocks' and the MoE blocks' shared
    experts (an MoE layer's routed experts are counted apart)."""
    moe = m.n_moe_layers / m.n_layers
    return (1 - moe) * m.ffn_hidden_dim + moe * m.n_shared_experts * m.expert_hidden_dim


def attention_on_rank(m: ModelConfig, tp: int) -> dict[str, tuple[float, float]]:
    """attention_linears' shapes (in, out) on one TP rank of `tp`."""
    split = {"out": lambda k, n: (k, n / tp), "in": lambda k, n: (k / tp, n), "whole": lambda k, n: (k, n)}
    return {name: split[how](k, n) for name, (k, n, how) in attention_linears(m).items()}


# An MoE layer's matmuls by name (titan_exp.models.moe): its router's, in fp32, then its routed
# experts' (expert i's w1, w3, w2, where they run one expert at a time), then its shared experts'.
ROUTER = "moe.router"
SHARED_LINEARS = ("moe.shared_experts.w1", "moe.shared_experts.w3", "moe.shared_experts.w2")


def block_matmuls(m: ModelConfig, moe: bool, looped_experts: int = 0) -> list[str]:
    """The matrix products (aten.mm) a block's forward runs, by name, in the order it runs them:
    the attention's linears (attention_linears), then a dense block's SwiGLU (FFN_LINEARS), or an
    MoE layer's router, its `looped_experts` local experts' w1, w3 and w2 where they run one at a
    time (on a CPU: models.moe.GroupedExperts; a GPU's grouped GEMM is not an aten.mm) and its
    shared experts'. Per-op selective AC saves the 1st, 3rd, 5th... of them and recomputes the
    others (titan_exp.parallel.activation_checkpoint.op_policy): `selective_saves`."""
    names = list(attention_linears(m))
    if not moe:
        return names + list(FFN_LINEARS)
    names.append(ROUTER)
    names += [f"moe.experts.{i}.{w}" for i in range(looped_experts) for w in ("w1", "w3", "w2")]
    return names + (list(SHARED_LINEARS) if m.n_shared_experts else [])


def selective_saves(names: list[str]) -> frozenset[str]:
    """Of a block's matmuls in order (block_matmuls), those per-op selective AC saves."""
    return frozenset(names[::2])


def selective_recomputed(m: ModelConfig) -> dict[str, float]:
    """The share of each matmul of the mean block that per-op selective AC recomputes on a GPU, by
    block_linears' names (an MoE layer's shared experts under FFN_LINEARS'), and ROUTER's: dense
    blocks' and MoE layers' each in their own order (block_matmuls), an FFN linear's weighted by
    each kind's SwiGLU width, of which the mean block's is the sum (perf.model.block)."""
    moe = m.n_moe_layers / m.n_layers
    redone = {kind: set(names) - selective_saves(names) for kind, names in
              ((False, block_matmuls(m, False)), (True, block_matmuls(m, True)))}
    share = {name: (1 - moe) * (name in redone[False]) + moe * (name in redone[True]) for name in attention_linears(m)}
    widths = ((1 - moe) * m.ffn_hidden_dim, moe * m.n_shared_experts * m.expert_hidden_dim)
    for dense, shared in zip(FFN_LINEARS, SHARED_LINEARS):
        recomputed = widths[0] * (dense in redone[False]) + widths[1] * (shared in redone[True])
        share[dense] = recomputed / (sum(widths) or 1)
    return share | {ROUTER: moe * (ROUTER in redone[True])}


def block_linears(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """The block's linears' whole shapes (in, out), before TP splits them: the attention's
    (attention_linears), then the SwiGLU's, the dense one's, or, in an MoE model without dense
    blocks, its shared experts'."""
    ffn = m.ffn_hidden_dim if m.n_moe_layers < m.n_layers else m.n_shared_experts * m.expert_hidden_dim
    attention = {name: (k, n) for name, (k, n, _) in attention_linears(m).items()}
    return attention | dict(zip(FFN_LINEARS, ((m.dim, ffn), (m.dim, ffn), (ffn, m.dim))))


def low_precision_linears(job: JobConfig) -> frozenset[str]:
    """The block_linears the precision converter swaps for low-precision ones (precision.converts:
    precision.filter_fqns, torchao's float8 shape filter, alignment); none without a converter."""
    return frozenset(name for name, (k, n) in block_linears(job.model).items()
                     if converts(job.precision, f"layers.0.{name}", k, n))


def float8_gathered(job: JobConfig) -> tuple[float, float]:
    """(parameters, weights) of the mean block, on one TP rank, that FSDP all-gathers in float8 (a
    byte each) under torchao's float8 all-gather (tensorwise float8 and
    precision.float8_enable_fsdp_all_gather, with FSDP sharding): the float8 linears', that is those
    of the attention's, the dense SwiGLU's and the shared experts' the converter swaps
    (low_precision_linears); not the norms, the router or the routed experts (not linears:
    precision.apply_converter). (0, 0) otherwise. Each is cast from
    its shard before the gather, so the linear does not cast its weight in the forward."""
    pr, m, p = job.precision, job.model, job.parallelism
    fsdp = p.data_parallel_shard_degree * p.context_parallel_degree > 1
    if not (fsdp and pr.converter == "float8" and pr.float8_recipe == "tensorwise"
            and pr.float8_enable_fsdp_all_gather):
        return 0.0, 0.0
    low, moe = low_precision_linears(job), m.n_moe_layers / m.n_layers
    shared = m.n_shared_experts * m.dim * m.expert_hidden_dim / p.tensor_parallel_degree
    swiglu = sum(name in low for name in FFN_LINEARS)  # of the dense SwiGLU's, and the shared experts'
    if m.mla:  # each of the attention's linears on one TP rank
        linears = [(k * n, 1) for name, (k, n) in attention_on_rank(m, p.tensor_parallel_degree).items() if name in low]
    else:
        (q, _), (kv, _) = block_tensors(job)[:2]
        linears = [(q, ("attention.wq" in low) + ("attention.wo" in low)),
                   (kv, ("attention.wk" in low) + ("attention.wv" in low))]
    ffn = m.dim * m.ffn_hidden_dim / p.tensor_parallel_degree
    linears += [(ffn, swiglu * (1 - moe)), (shared, swiglu * moe * (m.n_shared_experts > 0))]
    return sum(n * k for n, k in linears), sum(k for _, k in linears)


def block_tensors(job: JobConfig) -> Sizes:
    """The mean block's weights on one TP rank, as (elements, how many per block): q, k, v, o (under
    MLA each of its attention's linears) and the SwiGLU's three; in an MoE model's MoE layers
    (their share of the blocks) the routed experts' three stacked weights (1/ep of the experts, EP
    spanning TP's ranks; without EP all of them, 1/tp of each one's width) and the shared experts'."""
    m, p = job.model, job.parallelism
    tp, ep = p.tensor_parallel_degree, p.expert_parallel_degree
    moe = m.n_moe_layers / m.n_layers
    out = ([(k * n, 1.0) for k, n in attention_on_rank(m, tp).values()] if m.mla
           else [(m.dim * m.n_heads * m.head_size / tp, 2.0), (m.dim * m.kv_heads * m.head_size / tp, 2.0)])
    out += [(m.dim * m.ffn_hidden_dim / tp, 3 * (1 - moe))]
    if moe:
        out += [(m.n_experts / ep * m.dim * m.expert_hidden_dim / p.expert_width_split, 3 * moe)]
        if m.n_shared_experts:
            out += [(m.n_shared_experts * m.dim * m.expert_hidden_dim / tp, 3 * moe)]
    return out


def tp_degrees(m: ModelConfig, world: int) -> list[int]:
    """The TP degrees `world` ranks can split this model's block into (heads and SwiGLU width)."""
    return [tp for tp in range(1, world + 1)
            if world % tp == 0 and m.n_heads % tp == 0 and m.kv_heads % tp == 0 and m.ffn_hidden_dim % tp == 0]


def muon_matrices(m: ModelConfig) -> tuple[Matrices, Matrices]:
    """The mean block's matrices optimizer=muon orthogonalises (train.muon.is_matrix), whole, as
    (rows, cols, how many per block): (the attention's linears, the dense SwiGLU's and the shared
    experts'; the routed experts' stacks, each of n_experts matrices, in the MoE layers' share)."""
    moe = m.n_moe_layers / m.n_layers
    shared = m.n_shared_experts * m.expert_hidden_dim
    whole = [(k, n, 1.0) for k, n, _ in attention_linears(m).values()]
    whole += [(m.dim, m.ffn_hidden_dim, 3 * (1 - moe))] + ([(m.dim, shared, 3 * moe)] if shared and moe else [])
    return whole, ([(m.dim, m.expert_hidden_dim, 3 * moe)] if moe and m.n_experts else [])
