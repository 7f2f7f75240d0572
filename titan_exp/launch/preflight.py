"""Preflight: everything the launcher checks and prepares before anything of the run is written or
started, as an ordered list of steps. Each step takes the pending launch and returns it (possibly
with more filled in) and its errors; the first step with errors ends the preflight.

    ranks    cluster.nproc_per_node unset with a -1 degree: every visible GPU (torchrun's `gpu`); on a
             CPU one process, said loudly, since nothing is then sharded
    elastic  cluster.elastic: a layout its world size cannot use is re-planned for it (titan_exp.cluster.elastic)
    check    validation: the schema's bounds and every component's `check` (a layout that does not fit
             a resumed run's world size: with the hint that cluster.elastic=true re-plans it)
    hardware cluster.hardware: the file is read and fits the job; the job's predicted step and memory on
             it are logged (a dry run reports them with its own)
    evaluation  eval.tasks exist (the user's eval.include_path, else lm-eval's own task index)
    data     the default corpus and tokenizer exist (cached, offline); vocabulary vs model; data files
    resolve  derived values become numbers (world size, dp_shard, global batch, absolute paths)
    checkpoint  the folder is writable; the checkpoint the run would load is whole and fits the model and
             the optimizer (titan_exp.train.muon.state_names: AdamW's and Muon's state differ)
    cluster  SLURM: the controller can run the job (partitions, node sizes, time limit)
    machine  MFU's CPU peak, measured once here rather than by ranks competing for the cores
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from titan_exp import targets
from titan_exp.config import Executor, JobConfig
from titan_exp.record import RunDir
from titan_exp.validation import resolve, validate

logger = logging.getLogger("titan_exp.launch")


@dataclass(frozen=True)
class Pending:
    """A launch on its way through the preflight."""

    job: JobConfig
    run_dir: RunDir
    tokenizer: Path | None = None  # the tokenizer file the run will copy into its run dir

    def with_job(self, job: JobConfig) -> "Pending":
        return dataclasses.replace(self, job=job)


Step = Callable[[Pending], tuple[Pending, list[str]]]


def ranks(p: Pending) -> tuple[Pending, list[str]]:
    job, c = p.job, p.job.cluster
    derived = [name for name, d in job.parallelism.degrees.items() if d == -1]
    if c.nproc_per_node is not None or c.executor != Executor.local or not derived:
        return p, []
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count() // c.nnodes * c.nnodes
        logger.info("cluster.nproc_per_node unset: one rank per visible GPU, %d", gpus)
        return p.with_job(dataclasses.replace(job, cluster=dataclasses.replace(c, nproc_per_node=gpus // c.nnodes))), []
    if job.world_size == 1:
        logger.warning("cluster.nproc_per_node is unset, so this runs ONE process on this CPU and %s = -1 shards "
                       "over nothing; set cluster.nproc_per_node=N for N ranks", " and ".join(derived))
    return p, []


def elastic(p: Pending) -> tuple[Pending, list[str]]:
    from titan_exp.cluster.elastic import replanned

    job, errors = replanned(p.job, p.run_dir, "cluster.nproc_per_node")
    return p.with_job(job), errors


def check(p: Pending) -> tuple[Pending, list[str]]:
    from titan_exp.cluster.elastic import hinted

    return p, hinted(p.job, p.run_dir, validate(p.job))


def hardware(p: Pending) -> tuple[Pending, list[str]]:
    if p.job.cluster.hardware is None:
        return p, []
    from titan_exp.perf.model.predict import prediction, prediction_line
    from titan_exp.perf.rates.hardware import checked

    described, errors = checked(p.job)
    if errors or p.job.cluster.dry_run:
        return p, errors
    logger.info("%s\n%s", described.line(), prediction_line(prediction(resolve(p.job), described)))
    return p, []


def evaluation(p: Pending) -> tuple[Pending, list[str]]:
    if not p.job.eval.enable:
        return p, []
    from titan_exp.eval.tasks import task_errors

    return p, task_errors(p.job)


def data(p: Pending) -> tuple[Pending, list[str]]:
    from titan_exp.data import mixture
    from titan_exp.data.corpus import Tokenizer, assets
    from titan_exp.data.sources import launch_errors, pretokenized, store_errors, validation_source
    from titan_exp.models.llama import check_vocab

    d, tokenizer = assets(p.job.data)
    job = dataclasses.replace(p.job, data=d)
    errors = check_vocab(job.model, Tokenizer(tokenizer).vocab_size)
    if d.mixture:
        errors += mixture.file_errors(job)
    else:
        errors += launch_errors(d, validation_source(job) if job.validation.enable else None)
    if d.pretokenize and not errors:
        job = mixture.pretokenized(job, tokenizer) if d.mixture else pretokenized(job, tokenizer)
    for source in [s.data for s in mixture.sources(job.data)] if job.data.mixture else [job.data]:
        errors += store_errors(source, tokenizer, job.model.vocab_size)
    return dataclasses.replace(p, job=job, tokenizer=tokenizer), errors


def resolved(p: Pending) -> tuple[Pending, list[str]]:
    return p.with_job(resolve(p.job)), []


def model_shapes(job: JobConfig) -> dict[str, torch.Size]:
    """Parameter shapes of the configured model, from a meta-device instance (no memory)."""
    with torch.device("meta"):
        return {k: v.shape for k, v in targets.build(job, "model", job.model).state_dict().items()}


def checkpoint(p: Pending) -> tuple[Pending, list[str]]:
    if not p.job.checkpoint.enable:
        return p, []
    from titan_exp.checkpoint.manager import preflight
    from titan_exp.train.muon import state_names

    shapes = model_shapes(p.job)
    return p, preflight(p.job.checkpoint, p.run_dir.path, shapes, p.job.model,
                        optimizer_state=state_names(p.job.optimizer, shapes.items()))


def cluster(p: Pending) -> tuple[Pending, list[str]]:
    if p.job.cluster.executor != Executor.slurm or p.job.cluster.dry_run:  # a dry run submits nothing
        return p, []
    from titan_exp.cluster.slurm.preflight import preflight

    return p, preflight(p.job)


def machine(p: Pending) -> tuple[Pending, list[str]]:
    """MFU's denominator on a CPU: the matmul peak of the whole machine, measured here before
    any rank competes for the cores (the best seen so far, see best_cpu_peak_tflops), times each
    rank's share of the cores. Measured by each rank instead, the peak would depend on what the
    other ranks were doing at that moment. SLURM nodes are not this machine; a GPU rank looks its
    peak up by device name. A dry run is one process with the launcher's threads, whatever the
    layout's ranks per node: its rate is this CPU's, not a rank's share and not a GPU's."""
    job = p.job
    if job.metrics.peak_tflops is not None or job.cluster.executor == Executor.slurm or torch.cuda.is_available():
        return p, []
    from titan_exp.config.cluster import threads_per_rank
    from titan_exp.metrics import best_cpu_peak_tflops
    from titan_exp.precision import DTYPES

    peak = best_cpu_peak_tflops(DTYPES[job.precision.param_dtype])
    if job.cluster.dry_run:  # one process, with the threads the peak was measured with
        per_rank = peak
        logger.info("CPU %s matmul peak %.3f TFLOP/s with %d thread(s): the rate of the one process that simulates "
                    "rank %d (this CPU's, not a GPU's)", job.precision.param_dtype, peak, torch.get_num_threads(),
                    job.cluster.dry_run_rank)
    else:
        nproc, cores = job.cluster.nproc_per_node, os.cpu_count() or 1
        threads = threads_per_rank(nproc) if job.cluster.executor == Executor.local else torch.get_num_threads()
        per_rank = peak * min(threads, cores / nproc) / cores
        logger.info("CPU %s matmul peak %.3f TFLOP/s for %d cores; each of %d rank(s) gets %.3f",
                    job.precision.param_dtype, peak, cores, nproc, per_rank)
    return p.with_job(dataclasses.replace(job, metrics=dataclasses.replace(job.metrics, peak_tflops=per_rank))), []


STEPS: tuple[Step, ...] = (ranks, elastic, check, hardware, evaluation, data, resolved, checkpoint, cluster, machine)


def preflight(job: JobConfig, run_dir: RunDir, steps: tuple[Step, ...] = STEPS) -> tuple[Pending, list[str]]:
    """Run the steps in order; stop at the first that finds errors."""
    pending = Pending(job, run_dir)
    for step in steps:
        pending, errors = step(pending)
        if errors:
            return pending, errors
    return pending, []
