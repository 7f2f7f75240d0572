"""What every rank runs: `python -m titan_exp.train.rank RUN_DIR`.

The rank reads the resolved config the launcher wrote, validates it again, joins the process
group, trains, and rank 0 writes summary.json, on failure as well as on success.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from titan_exp import faults, targets
from titan_exp.config import JobConfig, load_job_config
from titan_exp.files import atomic_write
from titan_exp.record import RunDir, RunSummary, Status
from titan_exp.signals import Stopped, catch_stop_signals, stop_with_launcher, stoppable
from titan_exp.validation import ConfigError, validate

logger = logging.getLogger("titan_exp")


def setup_logging(run_dir: RunDir, rank: int, console_info: bool = False) -> None:
    """Every record to the rank's log file; to stdout, rank 0's from INFO up and the others' warnings
    (with `console_info` every rank's from INFO up: a dry run's one process, whichever rank it is)."""
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    file_handler = logging.FileHandler(run_dir.rank_log(rank))
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.setLevel(logging.INFO if rank == 0 or console_info else logging.WARNING)
    root = logging.getLogger()
    root.handlers[:] = [file_handler, console]
    root.setLevel(logging.INFO)


def init_distributed(init_timeout_seconds: int) -> torch.device:
    """CUDA + NCCL when there is a GPU, else CPU + gloo; rendezvous from the launcher's env.
    Collectives time out after comm.init_timeout_seconds until the first step (titan_exp.watchdog).
    A stop signal ends the wait for the other ranks at once (signals.Stopped)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"

    def join() -> None:  # on stoppable's thread, whose current CUDA device is its own
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=init_timeout_seconds))

    env = os.environ
    where = f"{env.get('MASTER_ADDR', 'localhost')}:{env.get('MASTER_PORT', '?')}, {env.get('WORLD_SIZE', '?')} ranks"
    stoppable(join, f"waiting for the other ranks at the rendezvous ({where})")
    return device


def slurm_job_id() -> str | None:
    """The SLURM job this rank runs in, if any (`<array job>_<task>` for an array member)."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")


def failure_status(exc: BaseException) -> Status:
    return Status.oom if isinstance(exc, torch.OutOfMemoryError) else Status.failed


def run(job: JobConfig, run_dir: RunDir) -> dict:
    """Train on this rank; the RunSummary fields of a finished run."""
    from titan_exp.parallel.compile import graph_cache_counts, use_compile_cache

    torch.use_deterministic_algorithms(job.training.deterministic)
    cache = use_compile_cache(job) if job.compile.enable else {}  # before anything compiles
    # Under SLURM: the run dir's snapshot, and the node this rank landed on.
    logger.info("titan_exp from %s, on host %s (pid %d)", Path(__file__).parent, socket.gethostname(), os.getpid())
    faults.inject("init", 0)
    faults.inject("hang", 0)
    device = init_distributed(job.comm.init_timeout_seconds)
    result = targets.build(job, "training", job, run_dir, device).train()  # a Trainer, or the user's subclass
    if job.compile.enable:
        counts = graph_cache_counts()
        hits, misses = counts["fx_graph_cache_hits"], counts["fx_graph_cache_misses"]
        warm = "none" if not hits + misses else "warm" if not misses else "cold" if not hits else "partial"
        cache |= counts | {"compile_cache": warm}
    return {**result, **cache}


class AtomicErrorHandler(ErrorHandler):
    """torch elastic's per-rank error file, written whole or not at all. When a peer dies, the
    agent stops the other ranks and reads their error files at once; a rank stopped while writing
    its file left it half-written, and the agent's own JSON parse of it crashed the launcher
    (JSONDecodeError in ProcessFailure) instead of reporting which rank died. (`_write_error_file`
    is torch's internal hook; were it gone, torch's plain writer would be used as before.)"""

    def _write_error_file(self, file_path: str, error_msg: str) -> None:
        try:
            atomic_write(Path(file_path), error_msg)
        except OSError as exc:
            logger.warning("could not write the error file %s: %s", file_path, exc)


def main(path: str) -> int:
    # Stop signals are recorded, not fatal, until the summary is written: when one rank dies the
    # agent SIGTERMs the others at once, and rank 0 must still say why the run ended (the agent
    # waits 30 s before SIGKILL). During training they stop the run at a step boundary. Caught
    # from the rank's first line: a peer lost at its start signals this one while it sets up.
    # The launcher's end, kill -9 included, stops the rank as SIGTERM would.
    with catch_stop_signals():
        stop_with_launcher()
        run_dir = RunDir(path)
        rank = int(os.environ.get("RANK", 0))
        setup_logging(run_dir, rank)
        start = time.time()
        job = load_job_config(run_dir.config)
        summary = RunSummary.of(job, Status.running, run_dir.path, slurm_job_id=slurm_job_id(),
                                layouts=run_dir.read_layouts() or None)
        try:
            errors = validate(job)
            if errors:
                raise ConfigError(errors)
            result = run(job, run_dir)
            summary = summary.replace(**result, status=Status.interrupted if "interrupted_by" in result else Status.ok)
            return 0
        except BaseException as exc:  # noqa: BLE001 - the summary must say why, whatever it was
            summary = summary.replace(status=failure_status(exc), error=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, Stopped):  # a stop signal, not a fault: no traceback
                logger.warning("rank %d: %s", rank, exc)
            else:
                logger.exception("rank %d failed", rank)
            raise
        finally:
            summary = summary.replace(wall_time_s=time.time() - start)
            if rank == 0:
                run_dir.write_summary(summary)
            if dist.is_initialized():
                if summary.status in (Status.ok, Status.interrupted):
                    dist.barrier()
                dist.destroy_process_group()


main = record(main, error_handler=AtomicErrorHandler())


if __name__ == "__main__":
    code = main(sys.argv[1])
    faults.inject("exit", 0)
    sys.exit(code)
