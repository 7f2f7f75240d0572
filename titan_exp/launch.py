"""The launcher: validate -> resolve -> write the run dir -> hand the ranks to an executor.

Nothing is spawned and nothing of the run is written until the whole config is valid.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig

from titan_exp import checkpoint
from titan_exp.cluster import get_executor
from titan_exp.config import JobConfig, to_job_config, to_yaml
from titan_exp.data.corpus import Tokenizer, default_corpus, trained_tokenizer
from titan_exp.precision import DTYPES
from titan_exp.run_dir import RunDir
from titan_exp.validation import data_file_errors, resolve, validate

logger = logging.getLogger("titan_exp.launch")

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 3


def prepare_data(job: JobConfig) -> tuple[JobConfig, Path]:
    """Make the default corpus and tokenizer exist (cached, offline) and point the config at
    the corpus file; returns (job, tokenizer file)."""
    data, corpus = job.data, default_corpus()
    if data.dataset == "pydoc_topics":
        data = dataclasses.replace(data, path=str(corpus))
    tokenizer = Path(data.tokenizer_path) if data.tokenizer_path else trained_tokenizer(corpus, data.tokenizer_vocab_size)
    return dataclasses.replace(job, data=data), tokenizer


def model_shapes(job: JobConfig) -> dict[str, torch.Size]:
    """Parameter shapes of the configured model, from a meta-device instance (no memory)."""
    from titan_exp.models.llama import Transformer

    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(job.model).state_dict().items()}


def resolve_cpu_peak(job: JobConfig) -> JobConfig:
    """MFU's denominator on a CPU: the matmul peak of the whole machine, measured here before
    any rank competes for the cores (the best seen so far, see best_cpu_peak_tflops), times each
    rank's share of the cores. Measured by each rank instead, the peak would depend on what the
    other ranks were doing at that moment."""
    if job.metrics.peak_tflops is not None or torch.cuda.is_available():
        return job  # a GPU rank looks its peak up by device name
    from titan_exp.cluster.local import threads_per_rank
    from titan_exp.metrics import best_cpu_peak_tflops

    nproc, cores = job.cluster.nproc_per_node, os.cpu_count() or 1
    threads = threads_per_rank(nproc) if job.cluster.executor == "local" else torch.get_num_threads()
    machine = best_cpu_peak_tflops(DTYPES[job.precision.param_dtype])
    per_rank = machine * min(threads, cores / nproc) / cores
    logger.info("CPU %s matmul peak %.3f TFLOP/s for %d cores; each of %d rank(s) gets %.3f",
                job.precision.param_dtype, machine, cores, nproc, per_rank)
    return dataclasses.replace(job, metrics=dataclasses.replace(job.metrics, peak_tflops=per_rank))


def explain_failure(summary: dict, error: str | None, record: RunDir) -> dict:
    """Which rank failed and why. Rank 0 writes the summary, so its error is often only the
    consequence (a connection reset, a collective timeout); the cause is a rank killed by a signal
    (executor's report, listed first) or a rank that hung (its step watchdog fired)."""
    from titan_exp.watchdog import hung_ranks

    rank0 = summary.get("error")
    if error and error != rank0:
        summary = {**summary, "rank_failures": error}
        cause = error.split("; ")[0]
        if " was killed by " in cause and not cause.endswith("SIGTERM"):
            summary["error"] = f"{cause}; rank 0 then: {rank0}"
    hung = hung_ranks(record.logs)
    if hung:
        logs = ", ".join(str(record.rank_log(k)) for k in hung)
        summary = {**summary, "hung_ranks": hung,
                   "error": f"rank(s) {', '.join(map(str, hung))} hung (their step watchdog fired; stacks in {logs}); "
                            f"rank 0 then: {rank0}"}
    record.write_summary(summary)
    return summary


def launch(cfg: DictConfig, run_dir: str, *, multirun: bool = False) -> int:
    """Run one job; returns an exit code. In a sweep an invalid member leaves a summary saying
    so; a single invalid run writes nothing."""
    job = to_job_config(cfg)
    record = RunDir(run_dir)
    errors = validate(job)
    if not errors:
        job, tokenizer = prepare_data(job)
        errors = validate(job, tokenizer_vocab=Tokenizer(tokenizer).vocab_size)
    if not errors:
        errors = data_file_errors(job.data)
    if not errors and job.checkpoint.enable:
        errors = checkpoint.preflight(job.checkpoint, record.path, model_shapes(job))
    if not errors and job.cluster.executor == "slurm":
        from titan_exp.cluster import slurm

        errors = slurm.preflight(resolve(job))
    if errors:
        logger.error("invalid config, nothing was started:\n  - %s", "\n  - ".join(errors))
        if multirun:
            from titan_exp.train import describe

            record.write_summary({"status": "invalid", **describe(job), "error": "; ".join(errors), "errors": errors})
        return EXIT_INVALID

    job = resolve(job)
    if job.cluster.executor != "slurm":  # the nodes are not this machine
        job = resolve_cpu_peak(job)
    record.path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer, record.tokenizer)
    job = dataclasses.replace(job, data=dataclasses.replace(job.data, tokenizer_path=str(record.tokenizer)))
    record.config.write_text(to_yaml(job))
    world = job.cluster.nnodes * job.cluster.nproc_per_node
    logger.info("run dir %s | %s executor, %d rank(s)", record.path, job.cluster.executor, world)

    error = get_executor(job.cluster.executor)(job, record)
    summary = record.read_summary()
    if summary is not None and summary["status"] == "pending":
        return EXIT_OK  # queued on SLURM; the executor said where
    if summary is None or summary["status"] == "running":
        # A rank died before it could write (killed, segfault): the launcher says so.
        summary = {**(summary or {}), "status": "failed", "error": error or "no summary written by rank 0"}
        record.write_summary(summary)
    elif error and summary["status"] == "ok":
        # gloo sometimes aborts in process teardown after every rank finished; the run is fine.
        logger.warning("training finished but a rank exited badly afterwards (%s); the run is ok", error)
    if summary["status"] in ("failed", "oom"):
        summary = explain_failure(summary, error, record)
    if summary["status"] == "interrupted":
        logger.warning("run interrupted by %s after step %d; relaunch with the same run dir to resume (summary %s)",
                       " and ".join(summary["interrupted_by"]), summary["interrupted_at_step"], record.summary)
        return EXIT_INTERRUPTED
    if summary["status"] == "ok":
        if "final_loss" in summary:
            logger.info("done: final loss %.4f, %.1f tokens/s/device, MFU %.1f%%, summary %s", summary["final_loss"],
                        summary["tokens_per_second_per_device"], summary["mfu"], record.summary)
        else:
            logger.info("done: no steps to train (%s), summary %s",
                        summary.get("seed_checkpoint") or f"resumed at step {summary.get('start_step', 1) - 1}",
                        record.summary)
        return EXIT_OK
    logger.error("run %s: %s (summary %s)", summary["status"], summary.get("error"), record.summary)
    return EXIT_FAILED
