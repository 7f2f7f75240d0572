"""A published row as the job it describes (issue 36), for benchmarks/published:
`job_for` (what a source leaves unstated is the assumption named there), the GPU's spec sheet
(`GPUS`) and its NVLink domain (`gpus_per_node`), the shapes of the MoE models this toolkit's block
can describe (`MOE_SHAPES`; MLA's in megatron.py), and why a row cannot be planned
(`skip_reason`)."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from titan_exp.config import ACMode, Executor, PipelineSchedule, compose_job

from .engines import ENGINES
from .megatron import MLA_SHAPES, mla_shape, pipeline_ends
from .rows import Row, recipe, scaling

# The data set's GPU names -> the spec sheets of titan_exp/perf/rates/devices.py.
GPUS = {"h100_96gb_500w": "h100_500w", "h100_sxm_80gb": "h100", "h100_80gb": "h100", "h100": "h100",
        "a100_80gb": "a100", "a100": "a100", "a100_40gb": "a100_40gb", "b200": "b200", "b300": "b300", "gb200": "gb200",
        "gb300": "gb300"}
# Rack-scale systems: GPUs in one NVLink domain (the spec's "node"); a run over several racks is
# taken to fill each with the largest share of its GPUs that divides them (an assumption).
NVLINK_DOMAIN = {"gb200": 72, "gb300": 72}

# The rows of models with multi-head latent attention (DeepSeek-V3's and Kimi K2's: 39 rows of
# Megatron-Bridge's). This toolkit trains MLA since 2026-11-28 (titan_exp.models.mla), and its GPU
# performance model prices it since the same day (perf.model.block). These rows were never predicted before:
# named held out here, on 2026-11-28, before any was; planned as megatron.py describes
# (their shapes, DeepSeek-V3's multi-token-prediction layer, the recipes' pipeline layouts).
MLA_MODELS = tuple(MLA_SHAPES)


def unstated_precision(row: Row) -> bool:
    """Megatron-Bridge's 25.09 rows, whose tables print no precision (28 rows). Planned since
    2026-12-03 at the precision their recipes ran (rows.scaling); until then refused.
    Held out: named here before any was predicted, and reported on a line of their own."""
    return row.source == "megatron_bridge" and not row["dtype"]


def skip_reason(row: Row) -> str | None:
    """Why a row cannot be planned, or None."""
    if not row["n_layers"] and row["model"] not in MOE_SHAPES and row["model"] not in MLA_MODELS:
        return ("MoE or hybrid model: no shape for it here (of the MoE models, Qwen3's and GPT-OSS's only: MOE_SHAPES; "
                "DeepSeek-V3's and Kimi K2's: MLA_MODELS)")
    if row["gpu"] not in GPUS:
        return f"no spec sheet for {row['gpu']}"
    if row["dtype"] == "fp4":
        return "NVFP4: no such precision here"
    if unstated_precision(row) and recipe(row) is None:
        return "precision not stated, and no recipe for it"
    if scaling(row) not in ("bf16", "fp8_cs", "fp8_mx"):
        return f"float8 recipe {scaling(row)}: not one of torchao's here"
    if not (row["tokens_per_s_per_gpu"] or row["mfu"] or row["tflops_per_gpu"]):
        return "no throughput published"
    return None


# The MoE models of Megatron-Bridge's tables that this toolkit's block can describe: Qwen3's (GQA
# with heads 128 wide, every layer's SwiGLU replaced by 128 routed experts, 8 a token, none shared;
# their per-head q and k norms, two small memory-bound kernels, are left out). Shapes from the model
# cards' config.json (huggingface.co/Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B), which
# Megatron-Bridge's recipes load (src/megatron/bridge/recipes/qwen/h100/qwen3_moe.py:
# AutoBridge.from_hf_pretrained); and GPT-OSS 120B's (below). Their rows are held out: named so on
# 2026-11-25, before any was predicted (`fitting_set` takes none of them).
MOE_SHAPES = {
    "qwen3_30b_a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
                          n_experts=128, top_k=8, moe_hidden_dim=768),
    "qwen3_235b_a22b": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, vocab_size=151936,
                            n_experts=128, top_k=8, moe_hidden_dim=1536),
    # openai/gpt-oss-120b's config.json. Its every other layer attends over a sliding window of 128
    # tokens, which this block cannot describe: priced as full attention (at 4,096 tokens about 6 %
    # of a step's FLOPs too many, so too slow); its attention sinks and biases are left out.
    "gpt_oss_120b": dict(dim=2880, n_layers=36, n_heads=64, n_kv_heads=8, head_dim=64, vocab_size=201088,
                         n_experts=128, top_k=4, moe_hidden_dim=2880),
}


def is_moe(row: Row) -> bool:
    return row["model"] in MOE_SHAPES or row["model"] in MLA_MODELS


@lru_cache(maxsize=None)
def _base(precision: str):
    return compose_job(["model=llama3_8b", f"precision={precision}"])


def job_for(row: Row):
    """The JobConfig of a published row. Assumptions where a source is silent:
    - a GELU MLP of width F (MPT, GPT) is a SwiGLU one of width 2F/3, rounded to a multiple of 16
      (float8's need): the same matmul FLOPs and parameters within 0.3 % (3 x d x 2F/3 =
      2 x d x F); MPT and Megatron's GPT tie the embedding to the
      output, as they do by default (under PP, where ties are refused here, untied: the same
      FLOPs, Megatron keeps a synchronized copy on the last stage); MPT's learned position embedding is left out;
    - no ffn size (Megatron-LM's GPT rows): 4 x hidden; no KV heads: as many as query heads;
    - no sequence length (TorchTitan's Tables 1 and 3-5): 8,192, TorchTitan's Llama 3 default;
    - no activation checkpointing column (Megatron): none; no compile column: off, unless the
      source's engine fuses its elementwise kernels itself (ENGINES: Transformer Engine), priced
      as compiled;
    - a bare "FP8", FP8 current scaling and 25.09's unstated FP8 (rows.scaling):
      torchao's tensorwise recipe; MXFP8: mxfp8; FSDP's shards gathered in bf16, as no table says
      otherwise (TorchTitan's float8 rows with float8 all-gather: tokens/s under 1 % up,
      BENCHMARKS.md);
    - Megatron data parallel without FSDP: replicated (its distributed optimizer shards only the
      optimizer states, which moves memory, not the step's traffic) where that composes, that is
      without TP, PP, CP or EP; with them, sharded (FSDP), the data parallel that composes here
      (expert parallel is carved out of it and TP); in an MoE model, sharded over the EP group only and
      replicated across the rest (HSDP): Megatron's distributed optimizer moves parameters and
      gradients across data parallel once a step, not each microbatch, and a rank's experts stay
      whole on it (set 2026-11-25 after the rows were examined: MOVED_TO_FIT);
    - an MoE model (MOE_SHAPES): its experts as many as the row's EP degree splits them over,
      tokens routed evenly (Megatron-Bridge's MoE benchmarks force-balance them);
    - the local batch is global / data-parallel ranks; without pipeline parallel, a stated micro
      batch below it is gradient accumulation; with it, the micro batch is the pipeline's (1 where
      unstated: Megatron-LM's table);
    - gpus per node: 8 unless stated.
    """
    gpus = int(row.num("gpus"))
    tp, pp, cp = (int(row.num(k, 1)) for k in ("tp", "pp", "cp"))
    dp = gpus // (tp * pp * cp)
    seq = int(row.num("seq_len", 8192))
    swiglu = row["source"] in ("torchtitan", "megatron_bridge")
    precision = {"fp8_cs": "float8", "fp8_mx": "mxfp8"}.get(scaling(row), "bf16")
    job = _base(precision)
    if is_moe(row):
        shape = mla_shape(row["model"]) if row["model"] in MLA_MODELS else MOE_SHAPES[row["model"]]
        model = dataclasses.replace(job.model, flavor=row["model"], **shape, max_seq_len=max(seq, 8192))
    else:
        hidden, heads = int(row.num("hidden")), int(row.num("heads"))
        ffn = int(row.num("ffn_hidden", 4 * hidden))
        model = dataclasses.replace(job.model, flavor=row["model"], dim=hidden, n_layers=int(row.num("n_layers")),
                                    n_heads=heads, n_kv_heads=int(row.num("kv_heads", heads)),
                                    vocab_size=int(row.num("vocab")),
                                    intermediate_size=ffn if swiglu else 16 * round(2 * ffn / 48),
                                    tie_word_embeddings=not swiglu and pp == 1, max_seq_len=max(seq, 8192))
    global_batch = row.num("global_batch")
    local = int(row.num("local_batch") or global_batch // dp)
    micro = int(row.num("micro_batch") or (1 if pp > 1 else local))
    fsdp = (row["fsdp"] not in ("", "0", "false") or row["source"] in ("torchtitan", "llm_foundry")
            or tp * pp * cp > 1 or is_moe(row))
    ep = int(row.num("ep", 1))
    shard = dp // moe_replicas(row) if fsdp else 1
    par = dataclasses.replace(job.parallelism, tensor_parallel_degree=tp, pipeline_parallel_degree=pp,
                              context_parallel_degree=cp, expert_parallel_degree=ep,
                              data_parallel_shard_degree=shard, data_parallel_replicate_degree=dp // shard,
                              enable_async_tensor_parallel=row["async_tp"] == "true"
                              or (tp > 1 and ENGINES[row.source].overlaps_tp))
    if pp > 1:
        vp = int(row.num("vp", 1))
        interleaved = vp > 1 or "interleaved" in row["pp_schedule"].lower()
        if row["source"] == "torchtitan":
            micro = local // pp  # TorchTitan (Dec 2024) split the local batch into as many microbatches as stages
        per_rank = (vp if vp > 1 else 2) if interleaved else 1
        ends = int(ends_counted(row))  # the embedding and the loss as a block each, or not
        first, last = (ends, ends) if row["model"] not in MLA_MODELS else layout_ends(row, pp * per_rank)
        par = dataclasses.replace(
            par, pipeline_parallel_schedule=PipelineSchedule["Interleaved1F1B" if interleaved else "1F1B"],
            pipeline_parallel_microbatch_size=micro, pipeline_parallel_stages_per_rank=per_rank,
            pipeline_parallel_first_stage_less_layers=first,
            pipeline_parallel_last_stage_less_layers=last)
    ac = row["activation_checkpointing"] or "none"
    accumulate = pp == 1 and micro < local
    training = dataclasses.replace(job.training, seq_len=seq, local_batch_size=micro if accumulate else local,
                                   global_batch_size=int(global_batch or local * dp))
    per_node = gpus_per_node(row)
    job = dataclasses.replace(
        job, model=model, parallelism=par, training=training,
        activation_checkpoint=dataclasses.replace(job.activation_checkpoint, mode=ACMode(ac)),
        compile=dataclasses.replace(job.compile, enable=row["compile"] == "true" or ENGINES[row.source].fused),
        cluster=dataclasses.replace(job.cluster, executor=Executor.slurm, nnodes=max(1, gpus // per_node),
                                    nproc_per_node=per_node, gpus_per_node=per_node))
    return job


def ends_counted(row: Row) -> bool:
    """Whether a row's pipeline counts the embedding and the loss as a block each: Megatron-Bridge's
    Llama 3.1 405B, whose recipe sets account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split (src/megatron/bridge/recipes/llama/llama3.py,
    llama31_405b_pretrain_config), as its 126 blocks need for every published layout (16 x 8, 16 x 4,
    8 x 4 stages: 128 counted split evenly, 126 not). Set 2026-11-27 with the toolkit's
    pipeline_parallel_{first,last}_stage_less_layers, for the five rows of 16 x 8 stages refused
    until then; held out: named here before any was predicted."""
    return row.source == "megatron_bridge" and row["model"] == "llama3.1_405b"


def layout_ends(row: Row, stages: int) -> tuple[int, int]:
    """An MLA row's pipeline ends (megatron.pipeline_ends) from the layout its recipe
    gives, where that layout has the row's stages; else (0, 0), the blocks split evenly, as
    Megatron does without a layout (account_for_embedding/loss_in_pipeline_split unset)."""
    rec = recipe(row)
    return (rec and pipeline_ends(rec["pipeline_layout"], stages)) or (0, 0)


def moe_replicas(row: Row) -> int:
    """An MoE row without FSDP: its data-parallel ranks over the EP group's (ep / (cp x tp)), each
    group a replica (HSDP, job_for); else 1."""
    gpus, tp, pp, cp, ep = (int(row.num(k, 1)) for k in ("gpus", "tp", "pp", "cp", "ep"))
    dp = gpus // (tp * pp * cp)
    if is_moe(row) and row["fsdp"] in ("", "0", "false") and ep % (cp * tp) == 0 and dp % (ep // (cp * tp)) == 0:
        return dp // (ep // (cp * tp))
    return 1


def ep_over_tp(row: Row) -> bool:
    """Whether a row's expert parallel reaches into its TP ranks (EP > data parallel x CP): the
    rows first planned when EP came to spread over TP (2026-11-27); held out, named here before
    any was predicted."""
    gpus, tp, pp, cp, ep = (int(row.num(k, 1)) for k in ("gpus", "tp", "pp", "cp", "ep"))
    return is_moe(row) and tp > 1 and ep > (gpus // (tp * pp * cp)) * cp


def gpus_per_node(row: Row) -> int:
    """GPUs that share NVLink: the row's, or 8; in a rack-scale system (NVLINK_DOMAIN) the largest
    divisor of the run's GPUs that fits in the rack."""
    gpus = int(row.num("gpus"))
    if row["gpu"] in NVLINK_DOMAIN:
        return max(d for d in range(1, min(gpus, NVLINK_DOMAIN[row["gpu"]]) + 1) if gpus % d == 0)
    return min(int(row.num("gpus_per_node", 8)), gpus)
