"""torch.compile per transformer block, with an inductor cache per compile-relevant config.

Blocks are compiled in place (`nn.Module.compile`), so parameter names do not change. Every
config that changes the graphs inductor builds (model shape, layout, precision, activation
checkpointing, compile options, async TP) gets its own cache directory: a cache shared between
layouts once served an async-TP graph (fused all-gather-matmul) to a run without it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch import nn

from titan_exp.cache import cache_dir
from titan_exp.config import JobConfig, problem, to_plain


def check(job: JobConfig, cuda: bool) -> list[str]:
    if job.compile.enable and job.parallelism.tensor_parallel_degree > 1 and not cuda:
        return [problem("compile.enable", True,
                        "with tensor_parallel_degree > 1 it fails on CPU in torch 2.13 (a DTensor redistribute's "
                        "backward receives a plain tensor); compile without TP, or run TP eager")]
    return []


def apply_compile(model: nn.Module, backend: str, fullgraph: bool) -> None:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)


def compile_key(job: JobConfig) -> dict:
    """The config fields that change compiled graphs."""
    node = to_plain(job)
    return {k: node[k] for k in ("model", "parallelism", "precision", "activation_checkpoint", "compile")} | {
        "seq_len": job.training.seq_len,
        "local_batch_size": job.training.local_batch_size,
    }


def inductor_cache_dir(job: JobConfig) -> Path:
    digest = hashlib.sha256(json.dumps(compile_key(job), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "inductor" / digest
