"""One rank in the launching process: for debuggers and quick looks; world size must be 1."""

from __future__ import annotations

import importlib
import socket
from typing import Optional

import torch

from titan_exp.cluster.env import TRAIN, scoped_env
from titan_exp.config import JobConfig
from titan_exp.config.cluster import cuda_alloc_conf
from titan_exp.record import RunDir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_debug(job: JobConfig, run_dir: RunDir, *, in_sweep: bool = False, entry: str = TRAIN) -> Optional[str]:
    rank = importlib.import_module(entry)

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    if torch.cuda.is_available() and (conf := cuda_alloc_conf(job.cluster)):
        # this process's allocator may be running already, so its settings change in place
        # (launched ranks read them from their environment: rank_env)
        torch.cuda.memory._set_allocator_settings(conf)
    with scoped_env(**env):
        try:
            rank.main(str(run_dir.path))
        except Exception as exc:  # noqa: BLE001 - reported like a failed rank
            return f"rank 0: {type(exc).__name__}: {exc}"
    return None
