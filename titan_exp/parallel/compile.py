"""torch.compile per transformer block, with an inductor cache whose graphs are per config and
whose kernels are shared.

Blocks are compiled in place (`nn.Module.compile`), so parameter names do not change.

The cache rule TorchTitan learned: a compiled graph must never be reused by a config whose
collectives differ (a cache shared between layouts once served an async-TP graph, with fused
all-gather-matmuls, to a run without async TP). Every config that changes what gets compiled
(model shape, layout, precision, activation checkpointing, compile options, async TP) therefore
gets its own cache key tag (`torch.compiler.config.cache_key_tag`), which is part of every FX-graph
and AOTAutograd cache key. What is safe to share is shared: all configs use one
TORCHINDUCTOR_CACHE_DIR, whose C++/Triton kernels are keyed by their source code, so a sweep's
second and later layouts find most kernels compiled (BENCHMARKS.md measures the difference).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from torch import nn

from titan_exp.cache import cache_dir
from titan_exp.config import JobConfig, to_plain


def apply_compile(model: nn.Module, backend: str, fullgraph: bool, round_as_eager: bool = False) -> None:
    """Each dense block whole. Of an MoE block, the attention and the shared experts: routing
    and dispatch have data-dependent shapes (tokens per expert, all-to-all splits read on the
    host), which would break a full graph at every MoE layer, so they stay eager.
    `round_as_eager` (precision.compile_rounds_as_eager) sets Inductor's emulate_precision_casts
    for this process's compiles; otherwise it is what TORCHINDUCTOR_EMULATE_PRECISION_CASTS says,
    so a run in the same process after one that set it does not inherit it."""
    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = (
        round_as_eager or os.environ.get("TORCHINDUCTOR_EMULATE_PRECISION_CASTS", "0") == "1")
    for block in model.layers.values():
        if hasattr(block, "moe"):
            block.attention.compile(backend=backend, fullgraph=fullgraph)
            if block.moe.shared_experts is not None:
                block.moe.shared_experts.compile(backend=backend, fullgraph=fullgraph)
        else:
            block.compile(backend=backend, fullgraph=fullgraph)


def compile_key(job: JobConfig) -> dict:
    """The config fields that change compiled graphs."""
    node = to_plain(job)
    return {k: node[k] for k in ("model", "parallelism", "precision", "activation_checkpoint", "compile")} | {
        "seq_len": job.training.seq_len,
        "local_batch_size": job.training.local_batch_size,
    }


def compile_cache_tag(job: JobConfig) -> str:
    return "titan-" + hashlib.sha256(json.dumps(compile_key(job), sort_keys=True).encode()).hexdigest()[:16]


def inductor_cache_dir() -> Path:
    """The one inductor cache of this machine's runs (kernels shared, graphs tagged per config)."""
    return cache_dir() / "inductor"


def use_compile_cache(job: JobConfig) -> dict[str, str]:
    """Point this process's compiles at the shared cache under this config's tag; before anything
    compiles. Returns what the run summary records."""
    import torch.compiler.config

    path, tag = inductor_cache_dir(), compile_cache_tag(job)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    torch.compiler.config.cache_key_tag = tag
    return {"compile_cache_dir": str(path), "compile_cache_tag": tag}


def graph_cache_counts() -> dict[str, int]:
    """FX-graph cache hits and misses of this process so far (inductor's own counters)."""
    from torch._dynamo.utils import counters

    return {"fx_graph_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_graph_cache_misses": counters["inductor"]["fxgraph_cache_miss"]}
