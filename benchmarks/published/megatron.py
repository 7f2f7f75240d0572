"""Megatron-Bridge's DeepSeek-V3 and Kimi K2 rows as jobs.job_for plans them (issue 36):
the models' shapes (multi-head latent attention, titan_exp.models.mla), the multi-token-prediction
layer DeepSeek-V3's recipes add, and the pipeline layouts the recipes give as strings.

Their 39 rows were named held out on 2026-11-28 (jobs.MLA_MODELS) before any was
predicted; what is written here was read from the recipes (benchmarks/data/published_recipes.csv)
and the model cards, before any prediction of them was seen.
"""

from __future__ import annotations

import re

# Model cards' config.json, as Megatron-Bridge's providers set them: DeepSeek-V3's
# (deepseek-ai/DeepSeek-V3, as conf/model/deepseek_v3_671b.yaml) and Kimi K2's (Megatron-Bridge
# v0.3.1 src/megatron/bridge/models/kimi/kimi_provider.py: DeepSeek-V3's block with 64 heads, 384
# experts and one dense block first). Left out, as the toolkit's model leaves them: the router's
# node-limited choice and YaRN's RoPE scaling (a few memory-bound ops).
MLA_SHAPES = {
    "deepseek_v3": dict(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, intermediate_size=18432,
                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        n_experts=256, top_k=8, n_shared_experts=1, moe_hidden_dim=2048, n_dense_layers=3),
    "kimi_k2": dict(dim=7168, n_layers=61, n_heads=64, vocab_size=163840, intermediate_size=18432,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    n_experts=384, top_k=8, n_shared_experts=1, moe_hidden_dim=2048, n_dense_layers=1),
}
# Multi-token prediction layers: DeepSeek-V3's recipes run one at every release (published_recipes.csv,
# mtp_num_layers; the 25.11 table's "w/o MTP" label is not what its files ran). Kimi K2's recipes set
# none, and from v0.4.0 take its Hugging Face config's, which the repository does not hold: none, as
# its layout string has no "m" (an assumption).
MTP_LAYERS = {"deepseek_v3": 1, "kimi_k2": 0}


def mla_shape(model: str) -> dict:
    """The model's fields for titan_exp's ModelConfig (over a Llama preset's: no GQA fields), its
    multi-token-prediction layer priced as one more block (that layer is a transformer block of
    the model, an MoE one here, with a projection of 2 x dim to dim beside it, left out: about a
    sixth of a block's FLOPs; and a second pass through the output head and loss: output_heads)."""
    shape = dict(MLA_SHAPES[model], n_kv_heads=None, head_dim=None)
    shape["n_layers"] += MTP_LAYERS[model]
    return shape


def output_heads(model: str) -> int:
    """How many times a microbatch passes through the output head and its loss on the last
    pipeline stage: once, and once more for each multi-token-prediction layer (DeepSeek-V3's
    shares the main model's output head: Megatron-Core's MultiTokenPredictionBlock computes its
    logits with the output layer; priced since 2026-11-28)."""
    return 1 + MTP_LAYERS.get(model, 0)


def pipeline_ends(recipe_layout: str, stages: int) -> tuple[int, int] | None:
    """(first_less, last_less) for titan_exp's pipeline split (pipeline_parallel_first_stage_less_layers,
    ..._last_...) of a Megatron pipeline layout string in `recipe_layout` (Megatron-Core's grammar:
    stages split by "|", "E" the embedding, "t" a decoder block, "m" a multi-token-prediction layer
    (a block here: mla_shape), "L" the loss, "x*n" and "(...)*n" repeats): how many blocks fewer
    than the middle stages its first and last stage hold. None where no layout string is given,
    it has another number of stages than `stages`, or its middle stages differ (the toolkit's split
    cannot place it)."""
    found = re.search(r"E[t\dm*|()]*L", recipe_layout)
    if not found:
        return None
    text = found.group(0)
    while (expanded := re.sub(r"\(([^()]*)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)) != text:
        text = expanded
    text = re.sub(r"([tm])\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    blocks = [s.count("t") + s.count("m") for s in text.strip("|").split("|")]
    if len(blocks) != stages or len(set(blocks[1:-1])) > 1 or len(blocks) < 3:
        return None
    middle = blocks[1]
    return middle - blocks[0], middle - blocks[-1]
