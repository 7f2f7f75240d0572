"""`cluster.elastic=true`: a run that resumes on a world size its layout cannot use (a preempted
job back on fewer nodes, a relaunch with another cluster.nproc_per_node) continues in the
planner's fastest layout for the new world, at the same global batch (gradient accumulation
absorbs the difference), from its newest complete checkpoint, which loads into any layout. The
planner predicts on the GPUs of cluster.hardware when it is set (and fits the layout in their
memory unless autotune.device_memory_gib is set), else from this machine's profile.

Where the world is learnt, before any rank starts:

    local  the launcher's preflight (titan_exp.launch.preflight.elastic), from cluster.nproc_per_node
    slurm  the job's batch script, before srun starts the ranks, from the allocation's node count
           (cluster.min_nodes lets a requeued job start on fewer nodes):
           `python -m titan_exp.cluster.elastic RUN_DIR`

Every layout the run used, from which checkpoint step, is kept in `<run dir>/layouts.json`
(titan_exp.record.LayoutSpan) and shows in summary.json as `layouts`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

from titan_exp.config import ACMode, Executor, JobConfig, layout_label, load_job_config, problem, to_yaml
from titan_exp.record import LayoutSpan, RunDir, RunSummary, Status

logger = logging.getLogger("titan_exp.launch")


def needs_a_plan(job: JobConfig) -> bool:
    """Whether the job's degrees cannot lay out on its world size and that is all that is wrong
    with it (anything else, validation names first)."""
    from titan_exp.parallel import dims
    from titan_exp.validation import validate

    mismatch = dims.check(job)[1]
    return bool(mismatch) and all(e in mismatch for e in validate(job))


def resume_step(job: JobConfig, run_dir: RunDir) -> int:
    """The checkpoint step a run in `run_dir` continues from; 0 for a start from scratch (or from
    weights alone)."""
    from titan_exp.checkpoint import CheckpointError, checkpoint_folder, load_source, read_marker

    if not job.checkpoint.enable:
        return 0
    try:
        path, parts = load_source(job.checkpoint, checkpoint_folder(job.checkpoint, run_dir.path))
    except CheckpointError:
        return 0  # the checkpoint preflight says why
    marker = read_marker(path) if path is not None and "train_state" in parts else None
    return marker["step"] if marker else 0


def hinted(job: JobConfig, run_dir: RunDir, errors: list[str]) -> list[str]:
    """`errors` with, on those that say the degrees do not lay out on the world size, that
    cluster.elastic=true would re-plan the layout: only where it would, for a run whose own folder
    holds a checkpoint to continue from (checkpoints on, elastic off). A fresh run's mismatch is
    the degrees' alone."""
    from titan_exp.checkpoint import checkpoint_folder, complete_steps
    from titan_exp.parallel import dims

    if job.cluster.elastic or not job.checkpoint.enable or not errors:
        return errors
    steps = complete_steps(checkpoint_folder(job.checkpoint, run_dir.path))
    mismatch = dims.check(job)[1]
    if not steps or not mismatch:
        return errors
    hint = (f"; or continue this run's checkpoint step-{max(steps)} on this world size with cluster.elastic=true, "
            "which re-plans the layout")
    return [e + hint if e in mismatch else e for e in errors]


def previous_job(run_dir: RunDir) -> JobConfig | None:
    """The resolved config the run dir's last segment ran with, if it has run before."""
    return load_job_config(run_dir.config) if run_dir.config.exists() else None


def replanned(job: JobConfig, run_dir: RunDir, world_field: str) -> tuple[JobConfig, list[str]]:
    """`job` in the planner's layout for its world size when its own degrees cannot use it and
    cluster.elastic is on; otherwise `job` unchanged (validation then names the mismatch).
    `world_field` names what set the world, for the errors."""
    if not (job.cluster.elastic and job.checkpoint.enable and needs_a_plan(job)):
        return job, []
    from titan_exp.perf.rates import hardware as hw
    from titan_exp.perf.search.layouts import global_batch_of, split_label
    from titan_exp.perf.search.planner import device_memory_gib, fastest_fitting
    from titan_exp.validation import ranks_have_gpus

    world, cuda = job.world_size, ranks_have_gpus(job)
    try:  # cluster.hardware: the file's GPUs, not this machine's profile
        hardware = hw.read(job)
    except ValueError as exc:
        return job, [str(exc)]
    before = previous_job(run_dir)
    global_batch = job.training.global_batch_size
    if global_batch <= 0:  # -1: the batch the run has trained with so far
        global_batch = before.training.global_batch_size if before else global_batch_of(job, world)
    job = dataclasses.replace(job, training=dataclasses.replace(job.training, global_batch_size=global_batch))
    sharing = world if job.cluster.executor != Executor.slurm else job.cluster.nproc_per_node  # ranks on this node
    memory = (hw.memory_gib(job, hardware) if hardware else
              job.autotune.device_memory_gib or device_memory_gib(sharing, cuda))
    profile = hw.profile(job, hardware) if hardware else None
    answer = fastest_fitting(job, world, cuda=cuda, memory_gib=memory, profile=profile)
    kept = ""
    if answer.job is None and answer.valid and job.activation_checkpoint.mode == ACMode.none:
        full = dataclasses.replace(job, activation_checkpoint=dataclasses.replace(
            job.activation_checkpoint, mode=ACMode.full))
        if (with_ac := fastest_fitting(full, world, cuda=cuda, memory_gib=memory, profile=profile)).job is not None:
            answer, kept = with_ac, "; activation_checkpoint.mode none -> full, which it needs to fit"
    value = getattr(job.cluster, world_field.split(".")[-1])
    if answer.job is None and not answer.valid:
        return job, [problem(world_field, value, f"cluster.elastic: no layout of {world} ranks validates for this "
                             f"model at global batch {global_batch}; choose another world size or "
                             "training.global_batch_size")]
    if answer.job is None:
        return job, [problem(world_field, value, f"cluster.elastic: no layout of {world} ranks fits in memory: the "
                             f"model needs at least {answer.least_gib:.2f} GiB per device ({answer.least_layout}, "
                             f"predicted) and each device has {memory:.2f} GiB; use more devices")]
    old = layout_label(before.parallelism.layout if before else job.parallelism.degrees)
    new = answer.job
    logger.warning("re-planned for world %d: %s -> %s (%s; predicted %.3g s/step, %.2f of %.2f GiB per device%s)%s",
                   world, old, layout_label(new.parallelism.layout), split_label(new), answer.step_s,
                   answer.memory_gib, memory, kept, f"; {hardware.line()}" if hardware else "")
    return new, []


def record_layout(job: JobConfig, run_dir: RunDir) -> list[LayoutSpan]:
    """Add the job's layout to the run's history when it is not the last one there; call before
    the run dir's config.yaml is replaced (a run that started without elastic has its first
    layout only there)."""
    spans = run_dir.read_layouts()
    if not spans and (before := previous_job(run_dir)) is not None:
        spans = [LayoutSpan(0, before.world_size, before.parallelism.layout)]
    now = LayoutSpan(resume_step(job, run_dir), job.world_size, job.parallelism.layout)
    if not spans or (spans[-1].world, spans[-1].layout) != (now.world, now.layout):
        spans.append(now)
        run_dir.write_layouts(spans)
    return spans


def on_allocation(run_dir: RunDir, nodes: int) -> int:
    """In a SLURM job, before its ranks start: the run's config for the `nodes` the allocation
    has (cluster.min_nodes..nnodes), re-planned if its layout cannot use them. Returns an exit
    code; on a refusal the summary says why."""
    job = load_job_config(run_dir.config)
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, nnodes=nodes))
    new, errors = replanned(job, run_dir, "cluster.min_nodes")
    if errors:
        logger.error("%s", "; ".join(errors))
        run_dir.write_summary(RunSummary.of(job, Status.failed, run_dir.path, error="; ".join(errors), errors=errors))
        return 1
    record_layout(new, run_dir)
    run_dir.config.write_text(to_yaml(new))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    sys.exit(on_allocation(RunDir(sys.argv[1]), int(os.environ["SLURM_JOB_NUM_NODES"])))
