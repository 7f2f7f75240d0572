"""Local processes through torch's elastic launcher (what torchrun uses), gloo on CPU: on a CPU
forked from a server that imported them once (titan_exp.cluster.forkserver), on GPUs started fresh."""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from typing import Optional

from titan_exp.cluster import forkserver
from titan_exp.cluster.env import TRAIN, checkout_path, scoped_env
from titan_exp.config import JobConfig
from titan_exp.config.cluster import rank_env, threads_per_rank
from titan_exp.record import RunDir
from titan_exp.signals import EXIT_INTERRUPTED, LAUNCHER_PID


def run_local(job: JobConfig, run_dir: RunDir, *, in_sweep: bool = False, entry: str = TRAIN) -> Optional[str]:
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(quiet_interrupted_ranks)
    nproc = job.world_size
    gpu = torch.cuda.is_available()
    forked = job.cluster.fork_ranks and not gpu and forkserver.ready()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, chosen by the OS: runs never collide
        max_restarts=0,
        monitor_interval=0.1,
        start_method="forkserver" if forked else "spawn",
    )
    try:
        env = rank_env(job.cluster, threads=threads_per_rank(nproc), gpu=gpu)
        env[LAUNCHER_PID] = str(os.getpid())  # a rank stops when this process ends (signals.stop_with_launcher)
        with scoped_env(**env, **checkout_path()):
            if forked:
                elastic_launch(config, entrypoint=forkserver.start_rank)(entry, str(run_dir.path), dict(os.environ))
            else:
                elastic_launch(config, entrypoint=sys.executable)("-m", entry, str(run_dir.path))
    except SignalException as exc:
        # SIGTERM/SIGINT to the launcher: the agent passed it on to the ranks and waited for
        # them to exit, which they do after they stop at a step boundary with a checkpoint
        # (titan_exp.signals; a forked rank: forkserver.finish).
        return f"the launcher received {signal.Signals(exc.sigval).name}"
    except ChildFailedError as exc:
        return describe_failures(exc.failures)
    return None


def quiet_interrupted_ranks(record: logging.LogRecord) -> bool:
    """Whether torch's agent may log `record`: not its traceback for a forked rank that exited with
    EXIT_INTERRUPTED (a stop signal sent to the ranks alone: forkserver.finish), whose run the
    summary and the launcher report as interrupted."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (str(record.msg).startswith("failed (exitcode") and args[:1] == (EXIT_INTERRUPTED,))


def describe_failures(failures: dict) -> str:
    """Every failed rank, the likely cause first: a rank killed by a signal other than the
    agent's own SIGTERM (the others then fail on a broken connection), then ranks that raised,
    earliest first, then those the agent stopped."""
    def order(item):
        rank, f = item
        killed = f.exitcode < 0 and -f.exitcode != signal.SIGTERM
        return (0 if killed else 1 if f.exitcode > 0 else 2, f.timestamp, rank)

    parts = []
    for rank, f in sorted(failures.items(), key=order):
        if f.exitcode < 0:
            parts.append(f"rank {rank} was killed by {signal.Signals(-f.exitcode).name}")
        else:
            message = f.message if isinstance(f.message, str) else f.message.get("message", "")
            parts.append(f"rank {rank} exited with code {f.exitcode}: {message}".strip().rstrip(":"))
    return "; ".join(parts)
