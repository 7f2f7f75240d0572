"""What every rank runs: `python -m titan_exp.train RUN_DIR`.

The rank reads the resolved config the launcher wrote, validates it again, joins the process
group, trains, and rank 0 writes summary.json, on failure as well as on success.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from titan_exp.config import JobConfig, load_job_config
from titan_exp.faults import maybe_fault
from titan_exp.run_dir import RunDir
from titan_exp.signals import catch_stop_signals
from titan_exp.validation import ConfigError, validate

logger = logging.getLogger("titan_exp")


def setup_logging(run_dir: RunDir, rank: int) -> None:
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S")
    file_handler = logging.FileHandler(run_dir.rank_log(rank))
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root = logging.getLogger()
    root.handlers[:] = [file_handler, console]
    root.setLevel(logging.INFO)


def init_distributed(init_timeout_seconds: int) -> torch.device:
    """CUDA + NCCL when there is a GPU, else CPU + gloo; rendezvous from the launcher's env.
    Collectives time out after comm.init_timeout_seconds until the first step (titan_exp.watchdog)."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=init_timeout_seconds))
    return device


def describe(job: JobConfig) -> dict:
    """What the run was, for the summary and for sweep reports."""
    p = job.parallelism
    return {
        "model": job.model.flavor,
        "precision": job.precision.name,
        "world_size": job.cluster.nnodes * (job.cluster.nproc_per_node or 1),
        "layout": {
            "pp": p.pipeline_parallel_degree,
            "dp_replicate": p.data_parallel_replicate_degree,
            "dp_shard": p.data_parallel_shard_degree,
            "cp": p.context_parallel_degree,
            "tp": p.tensor_parallel_degree,
        },
        "compile": job.compile.enable,
        "activation_checkpoint": job.activation_checkpoint.mode,
        "global_batch_size": job.training.global_batch_size,
        "seq_len": job.training.seq_len,
    }


def slurm_job() -> dict[str, str]:
    """The SLURM job this rank runs in, if any (`<array job>_<task>` for an array member)."""
    if "SLURM_ARRAY_JOB_ID" in os.environ:
        return {"slurm_job_id": f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"}
    return {"slurm_job_id": os.environ["SLURM_JOB_ID"]} if "SLURM_JOB_ID" in os.environ else {}


def failure_status(exc: BaseException) -> str:
    return "oom" if isinstance(exc, torch.OutOfMemoryError) else "failed"


def run(job: JobConfig, run_dir: RunDir) -> dict:
    """Train on this rank; the summary fields of a finished run."""
    from titan_exp.parallel.compile import inductor_cache_dir
    from titan_exp.trainer import Trainer

    torch.use_deterministic_algorithms(job.training.deterministic)
    extra = {}
    if job.compile.enable:
        # Before anything compiles: this config's own inductor cache.
        cache = inductor_cache_dir(job)
        extra = {"compile_cache": "warm" if cache.exists() and any(cache.iterdir()) else "cold",
                 "compile_cache_dir": str(cache)}
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    logger.info("titan_exp from %s", Path(__file__).parent)  # under SLURM: the run dir's snapshot
    device = init_distributed(job.comm.init_timeout_seconds)
    return {**Trainer(job, run_dir, device).train(), **extra}


@record
def main(path: str) -> int:
    run_dir = RunDir(path)
    rank = int(os.environ.get("RANK", 0))
    setup_logging(run_dir, rank)
    start = time.time()
    job = load_job_config(run_dir.config)
    summary: dict = {"status": "running", "run_dir": str(run_dir.path), **describe(job), **slurm_job()}
    try:
        errors = validate(job)
        if errors:
            raise ConfigError(errors)
        with catch_stop_signals():
            result = run(job, run_dir)
        summary.update(result, status="interrupted" if "interrupted_by" in result else "ok")
        return 0
    except BaseException as exc:  # noqa: BLE001 - the summary must say why, whatever it was
        summary.update(status=failure_status(exc), error=f"{type(exc).__name__}: {exc}")
        logger.exception("rank %d failed", rank)
        raise
    finally:
        summary["wall_time_s"] = time.time() - start
        if rank == 0:
            run_dir.write_summary(summary)
        if dist.is_initialized():
            if summary["status"] in ("ok", "interrupted"):
                dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main(sys.argv[1])
    maybe_fault("exit", 0)
    sys.exit(code)
