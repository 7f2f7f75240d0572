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

from omegaconf import OmegaConf
from torch import nn

from titan_exp.config import JobConfig
from titan_exp.cache import cache_dir

BACKENDS = ("inductor", "aot_eager", "eager")


def apply_compile(model: nn.Module, backend: str, fullgraph: bool) -> None:
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=fullgraph)


def compile_key(job: JobConfig) -> dict:
    """The config fields that change compiled graphs."""
    node = OmegaConf.to_container(OmegaConf.structured(job))
    return {k: node[k] for k in ("model", "parallelism", "precision", "activation_checkpoint", "compile")} | {
        "seq_len": job.training.seq_len,
        "local_batch_size": job.training.local_batch_size,
    }


def inductor_cache_dir(job: JobConfig) -> Path:
    digest = hashlib.sha256(json.dumps(compile_key(job), sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "inductor" / digest
