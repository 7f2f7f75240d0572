"""Validation: one pure function from a JobConfig to every error it has, and the resolution of
derived values (dp_shard=-1, nproc_per_node, global batch, absolute paths) on a valid config.

The rules live with the components they configure: each module has a `check` (and the parallel
techniques a `check` that also takes the resolved ParallelDims); those of the parts above this
module on the launch path (the executors, the autotune search) live beside their schema in
titan_exp.config, so validation imports nothing above it. This module only gathers them,
after the schema's own bounds (`doc(..., min=...)`), which the others divide by, and the rule
that every float is finite unless its field takes +inf (titan_exp.config.values). Each message
reads `field = value: what is wrong; how to fix it`, naming the field the user typed. The
launcher runs this once before anything is spawned or written; every rank runs it again on the
resolved config it reads.
"""

from __future__ import annotations

import dataclasses
import functools
import os

from titan_exp import eval as evaluation
from titan_exp import metrics, precision, record, targets, watchdog
from titan_exp.checkpoint import manager as checkpoint
from titan_exp.config import Executor, JobConfig, autotune, cluster, problem
from titan_exp.config.values import nonfinite_errors
from titan_exp.data import loader, mixture
from titan_exp.data import sources as data
from titan_exp.models import hf, llama
from titan_exp.parallel import activation_checkpoint, context, dims, expert, fsdp, pipeline, tensor
from titan_exp.train import optim, profiling

# check(job, cuda) -> errors, for every config; then check(job, dims, cuda) once the layout is known.
CHECKS = (llama.check, hf.check, optim.check, metrics.check, watchdog.check, data.check, mixture.check, precision.check,
          activation_checkpoint.check, checkpoint.check, cluster.check, autotune.check,
          record.check, profiling.check, targets.check, evaluation.check)
LAYOUT_CHECKS = (loader.check_batch, fsdp.check, tensor.check, context.check, pipeline.check, expert.check)


class ConfigError(ValueError):
    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("invalid config:\n  - " + "\n  - ".join(errors))


@functools.cache
def _bounds() -> tuple[tuple[str, str, int], ...]:
    """(group, field, lower bound) of every schema field that has one (`doc(..., min=...)`)."""
    return tuple((group.name, f.name, f.metadata["min"]) for group in dataclasses.fields(JobConfig)
                 if dataclasses.is_dataclass(group.default_factory)
                 for f in dataclasses.fields(group.default_factory) if f.metadata.get("min") is not None)


def bound_errors(job: JobConfig) -> list[str]:
    """Every field whose schema gives a lower bound (`min`) and whose value is below it."""
    errors = []
    for group, name, low in _bounds():
        value = getattr(getattr(job, group), name)
        if value < low:
            errors.append(problem(f"{group}.{name}", value, f"must be >= {low}"))
    return errors


def ranks_have_gpus(job: JobConfig) -> bool:
    """Whether the job's ranks get GPUs: SLURM's gpus_per_node for cluster=slurm (the nodes', not
    the submitting machine's), else this machine."""
    if job.cluster.executor == Executor.slurm:
        return job.cluster.gpus_per_node > 0
    import torch

    return torch.cuda.is_available()


def validate(job: JobConfig, *, cuda: bool | None = None) -> list[str]:
    """Every error in `job`. `cuda`: whether the ranks will have GPUs (default: ranks_have_gpus)."""
    cuda = ranks_have_gpus(job) if cuda is None else cuda
    errors = bound_errors(job) + nonfinite_errors(job)
    if errors:
        return errors  # the rules below divide by these, and NaN passes every comparison
    for check in CHECKS:
        errors += check(job, cuda)
    if job.cluster.nproc_per_node is not None and job.cluster.nproc_per_node < 1:
        return errors  # no world size to lay the degrees out on (cluster.check said why)
    layout, layout_errors = dims.check(job)
    errors += layout_errors
    if layout is not None:
        for check in LAYOUT_CHECKS:
            errors += check(job, layout, cuda)
    return errors


def resolve(job: JobConfig) -> JobConfig:
    """Fill the derived values of a valid config, so the ranks and the record see numbers."""
    world = job.world_size
    d, k = job.data, job.checkpoint

    def absolute(path: str | None) -> str | None:  # the ranks may start in another directory (SLURM)
        return os.path.abspath(os.path.expanduser(path)) if path else path

    return dataclasses.replace(
        job,
        data=mixture.absolute(dataclasses.replace(d, path=absolute(d.path), tokenizer_path=absolute(d.tokenizer_path))),
        checkpoint=dataclasses.replace(k, initial_load_path=absolute(k.initial_load_path)),
        eval=dataclasses.replace(job.eval, include_path=absolute(job.eval.include_path)),
        cluster=dataclasses.replace(job.cluster, nproc_per_node=world // job.cluster.nnodes,
                                    hardware=absolute(job.cluster.hardware)),
        parallelism=dataclasses.replace(job.parallelism,
                                        data_parallel_shard_degree=job.parallelism.dp_shard_at(world)),
        training=dataclasses.replace(job.training, global_batch_size=job.global_batch_at(world)),
    )


def resolved(job: JobConfig) -> JobConfig:
    """`job` as resolve fills it, unless it already is (its data-parallel shard degree is a number):
    what the cost model takes, from a plan's resolved candidates or a user's config as composed."""
    return resolve(job) if job.parallelism.data_parallel_shard_degree == -1 else job
