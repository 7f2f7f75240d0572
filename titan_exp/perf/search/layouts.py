"""The layouts a plan ranges over: every assignment of degrees to the mesh dims of N devices, each
job as it would run (its degrees, its split of the global batch into local batch, accumulation and
pipeline microbatch), kept when titan_exp.validation accepts it, the same check the launcher runs.
"""

from __future__ import annotations

import dataclasses
import itertools

from titan_exp.config import LAYOUT_FIELDS, MESH_DIMS, JobConfig, layout_label, world_of
from titan_exp.validation import resolve, validate


def degrees_of(job: JobConfig) -> dict[str, int]:
    """The job's layout: its mesh degrees, and ep when expert parallel is on."""
    return job.parallelism.layout


def layout_overrides(job: JobConfig) -> list[str]:
    """The overrides that give another job this job's layout and batch split: its local batch and,
    under PP, its microbatch and how many blocks each end of the pipeline counts as (stage_overrides;
    for an MoE model, its expert parallel degree too, 1 included)."""
    layout = degrees_of(job) | ({"ep": job.parallelism.expert_parallel_degree} if job.model.is_moe else {})
    p = job.parallelism
    microbatch = ([f"parallelism.pipeline_parallel_microbatch_size={p.pipeline_parallel_microbatch_size}"]
                  if p.pipeline_parallel_degree > 1 else [])
    return [f"parallelism.{LAYOUT_FIELDS[dim]}={d}" for dim, d in layout.items()] + [
        f"training.local_batch_size={job.training.local_batch_size}", *microbatch, *stage_overrides(job)]


def stage_overrides(job: JobConfig) -> list[str]:
    """Under PP, the pair that splits its blocks over the stages (as perf.search.stages chose it, or
    the user set it): `parallelism.pipeline_parallel_first_stage_less_layers=K ..._last_stage_less_layers=L`."""
    p = job.parallelism
    if p.pipeline_parallel_degree == 1:
        return []
    return [f"parallelism.pipeline_parallel_first_stage_less_layers={p.pipeline_parallel_first_stage_less_layers}",
            f"parallelism.pipeline_parallel_last_stage_less_layers={p.pipeline_parallel_last_stage_less_layers}"]


def split_label(job: JobConfig) -> str:
    """How a job splits its global batch: the local batch, its accumulation steps, the PP microbatch."""
    t, p, accumulation = job.training, job.parallelism, job.accumulation
    out = f"local batch {t.local_batch_size}" + (f" x {accumulation} accumulated" if accumulation > 1 else "")
    return out + (f", microbatch {p.pipeline_parallel_microbatch_size}" if p.pipeline_parallel_degree > 1 else "")


def with_layout(job: JobConfig, degrees: dict[str, int], global_batch: int, *, local_batch_size: int | None = None,
                microbatch_size: int | None = None) -> JobConfig:
    """`job` with these degrees, `global_batch` sequences per step, and the given local batch (and
    PP microbatch), or the largest local batch (at most the configured one) that divides it."""
    degrees = {"ep": 1} | degrees  # a layout without ep has none
    p = dataclasses.replace(job.parallelism, **{LAYOUT_FIELDS[dim]: d for dim, d in degrees.items()})
    if microbatch_size is not None:
        p = dataclasses.replace(p, pipeline_parallel_microbatch_size=microbatch_size)
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    local = local_batch_size or min(job.training.local_batch_size, max(1, global_batch // dp))
    while local_batch_size is None and local > 1 and global_batch % (local * dp):
        local -= 1
    world = world_of(degrees)
    nodes = job.cluster.nodes_for(world)
    return dataclasses.replace(
        job, parallelism=p,
        training=dataclasses.replace(job.training, local_batch_size=local, global_batch_size=global_batch),
        cluster=dataclasses.replace(job.cluster, nnodes=nodes, nproc_per_node=world // nodes),
    )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int, n_experts: int = 0) -> list[dict[str, int]]:
    """Every assignment of degrees to the five mesh dims whose product is `world`; for an MoE
    model (`n_experts` > 0) each also with every expert parallel degree that divides the experts
    and dp_shard x cp x tp (validation decides which of those can be carved)."""
    out = []
    for pp, rep, shard, cp in itertools.product(divisors(world), repeat=4):
        rest = pp * rep * shard * cp
        if world % rest == 0:
            degrees = dict(zip(MESH_DIMS, (pp, rep, shard, cp, world // rest)))
            out.append(degrees)
            carved = shard * cp * degrees["tp"]
            out += [degrees | {"ep": ep} for ep in range(2, carved + 1)
                    if n_experts and n_experts % ep == 0 and carved % ep == 0]
    return out


def global_batch_of(job: JobConfig, world: int) -> int:
    """The global batch every layout of `world` ranks is compared at: the job's own there
    (JobConfig.global_batch_at: with none set, its local batch on each data-parallel rank of its
    configured layout); where that layout does not fit `world` ranks, its local batch on each."""
    if job.parallelism.lays_out(world):
        return job.global_batch_at(world)
    gb = job.training.global_batch_size
    return gb if gb > 0 else job.training.local_batch_size * world


def configured_layout(job: JobConfig, world: int) -> dict[str, int]:
    """The job's layout on `world` ranks, dp_shard = -1 taking the rest (ParallelismConfig.dp_shard_at)."""
    return job.parallelism.layout | {"dp_shard": job.parallelism.dp_shard_at(world)}


def batch_line(job: JobConfig, world: int) -> str:
    """The global batch the plan compares layouts at, and which fields give it."""
    t, p = job.training, job.parallelism
    if t.global_batch_size != -1:
        why = "training.global_batch_size"
    elif p.lays_out(world):
        dp = p.dp_at(world)
        why = (f"training.local_batch_size {t.local_batch_size} x {dp} data-parallel rank{'s' if dp > 1 else ''} "
               f"of the configured layout, {layout_label(configured_layout(job, world))}")
    else:
        why = f"training.local_batch_size {t.local_batch_size} x {world} devices"
    sequences = global_batch_of(job, world)
    return (f"global batch: {sequences:,} sequences = {sequences * t.seq_len:,} tokens for every layout, from "
            f"{why}")


def valid_layouts(job: JobConfig, world: int, *, cuda: bool = False) -> list[JobConfig]:
    """Every layout of `world` devices that validates at the job's global batch and its local
    batch (or the largest below it that divides the global batch)."""
    global_batch = global_batch_of(job, world)
    jobs = (with_layout(job, degrees, global_batch) for degrees in factorizations(world, job.model.n_experts))
    return [resolve(j) for j in jobs if not validate(j, cuda=cuda)]


# The fields a batch split sets, as validation's messages name them (`field = value: ...`).
SPLIT_FIELDS = ("training.local_batch_size", "training.global_batch_size",
                "parallelism.pipeline_parallel_microbatch_size")


def split_jobs(job: JobConfig, degrees: dict[str, int], global_batch: int, *, cuda: bool = False) -> list[JobConfig]:
    """The job with these degrees at every split of `global_batch`, not yet validated: each local
    batch that divides a rank's share (the rest accumulates) and, under PP, each microbatch that
    divides the local batch; none where the layout is refused for anything but its split."""
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if global_batch % dp:
        return []
    # A layout refused for anything but its split is refused at every split.
    if any(not e.startswith(SPLIT_FIELDS) for e in validate(with_layout(job, degrees, global_batch), cuda=cuda)):
        return []
    return [with_layout(job, degrees, global_batch, local_batch_size=local, microbatch_size=microbatch)
            for local in divisors(global_batch // dp)
            for microbatch in (divisors(local) if degrees["pp"] > 1 else [None])]


def batch_splits(job: JobConfig, degrees: dict[str, int], global_batch: int, *, cuda: bool = False) -> list[JobConfig]:
    """The job with these degrees at every split of `global_batch` that validates (split_jobs)."""
    return [resolve(j) for j in split_jobs(job, degrees, global_batch, cuda=cuda) if not validate(j, cuda=cuda)]
