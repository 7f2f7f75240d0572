"""Jobs and spec-sheet kernels the GPU model's tests (tests/test_gpu_model*.py) price."""

from __future__ import annotations

from titan_exp.config import compose_job
from titan_exp.perf.rates import kernels as rates
from titan_exp.perf.rates.devices import SPECS
from titan_exp.validation import resolve

H100 = SPECS["h100"]
K100 = rates.spec_kernels(H100, "flash")


def llama8b(*overrides: str):
    return resolve(compose_job(["model=llama3_8b", "precision=bf16", "training.seq_len=8192",
                                "training.local_batch_size=2", "training.global_batch_size=16",
                                "parallelism.data_parallel_shard_degree=8", "cluster.nproc_per_node=8", *overrides]))


def olmoe_job(ep: int, *overrides: str):
    return resolve(compose_job(["model=olmoe_1b_7b", "precision=bf16", "training.seq_len=1024",
                                "training.local_batch_size=1", "training.global_batch_size=8",
                                "parallelism.data_parallel_shard_degree=8",
                                f"parallelism.expert_parallel_degree={ep}", "cluster.nproc_per_node=8", *overrides]))
