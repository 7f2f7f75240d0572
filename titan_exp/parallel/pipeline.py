"""Pipeline parallel with `torch.distributed.pipelining`.

The model (still on the meta device) is cut into pp * stages_per_rank stages of consecutive
blocks; the first stage keeps the embedding, the last the final norm and output. Stages are
copies of the whole model with the other modules deleted, so every parameter keeps its fully
qualified name. Ranks hold one stage (GPipe, 1F1B), several in a loop (rank r holds r, r+pp,
...: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) or two in a V (rank r holds r and
2pp-1-r: ZBVZeroBubble, DualPipeV).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules

from titan_exp.config import JobConfig, ParallelismConfig, PipelineSchedule, problem

# The schedules (PipelineSchedule, in the schema) by how many stages a rank holds.
SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
assert {s.value for s in PipelineSchedule} == set(SINGLE_STAGE + LOOPED + V_SHAPED)


def stages_per_rank(p: ParallelismConfig, n_layers: int) -> int:
    """From layers_per_stage if set (stages = n_layers / it, spread over the pp ranks), else
    stages_per_rank if set, else what the schedule needs: 1, or 2 for looped and V schedules."""
    if p.pipeline_parallel_layers_per_stage is not None:
        return n_layers // p.pipeline_parallel_layers_per_stage // p.pipeline_parallel_degree
    if p.pipeline_parallel_stages_per_rank is not None:
        return p.pipeline_parallel_stages_per_rank
    return 1 if p.pipeline_parallel_schedule in SINGLE_STAGE else 2


def check(job: JobConfig, dims, cuda: bool) -> list[str]:
    """Stages, schedule and microbatches must fit the model and the batch."""
    if dims.pp == 1:
        return []
    e: list[str] = []
    p, m, t = job.parallelism, job.model, job.training
    sched = p.pipeline_parallel_schedule
    lps = p.pipeline_parallel_layers_per_stage
    if lps is not None:
        if lps < 1 or m.n_layers % lps:
            return [problem("parallelism.pipeline_parallel_layers_per_stage", lps, f"must divide model.n_layers = {m.n_layers}")]
        if (m.n_layers // lps) % dims.pp:
            return [problem("parallelism.pipeline_parallel_layers_per_stage", lps,
                            f"gives {m.n_layers // lps} stages, not a multiple of pipeline_parallel_degree = {dims.pp}")]
        spr = p.pipeline_parallel_stages_per_rank
        if spr is not None and spr != m.n_layers // lps // dims.pp:
            return [problem("parallelism.pipeline_parallel_stages_per_rank", spr,
                            f"contradicts layers_per_stage = {lps} ({m.n_layers // lps // dims.pp} per rank); set only one")]
    per_rank = stages_per_rank(p, m.n_layers)
    if sched in SINGLE_STAGE and per_rank != 1:
        e.append(problem("parallelism.pipeline_parallel_stages_per_rank", per_rank,
                         f"{sched} runs one stage per rank; set it to 1 (or null) or pick a looped schedule"))
    if sched in V_SHAPED and per_rank != 2:
        e.append(problem("parallelism.pipeline_parallel_stages_per_rank", per_rank, f"{sched} needs exactly 2 (a V)"))
    if sched in LOOPED and per_rank < 2:
        e.append(problem("parallelism.pipeline_parallel_stages_per_rank", per_rank, f"{sched} needs >= 2 stages per rank"))
    stages = dims.pp * per_rank
    if stages > m.n_layers:
        e.append(problem("parallelism.pipeline_parallel_degree", dims.pp,
                         f"{dims.pp} ranks x {per_rank} stages = {stages} stages but model.n_layers = {m.n_layers}; "
                         "every stage needs a block"))
    mbs = p.pipeline_parallel_microbatch_size
    if t.local_batch_size % mbs:
        e.append(problem("parallelism.pipeline_parallel_microbatch_size", mbs,
                         f"must divide training.local_batch_size = {t.local_batch_size}"))
    else:
        n_mb = t.local_batch_size // mbs
        if sched not in SINGLE_STAGE and n_mb % dims.pp:
            e.append(problem("training.local_batch_size", t.local_batch_size,
                             f"{sched} needs the microbatch count ({n_mb}) to be a multiple of pipeline_parallel_degree "
                             f"= {dims.pp}; raise local_batch_size or lower pipeline_parallel_microbatch_size"))
        elif n_mb < dims.pp:
            e.append(problem("training.local_batch_size", t.local_batch_size,
                             f"gives {n_mb} microbatches for {dims.pp} pipeline ranks; need at least one per rank"))
    if m.tie_word_embeddings:
        e.append(problem("model.tie_word_embeddings", True,
                         "tied embeddings span the first and last stage, which pipeline parallel does not support "
                         "yet; untie them (model.tie_word_embeddings=false) or use another layout"))
    return e


def stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


@dataclass(frozen=True)
class RankLoad:
    """What one pipeline rank holds: its stages, their blocks, and the model's ends."""

    stages: int
    blocks: int
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the output projection and the loss


def rank_loads(p: ParallelismConfig, n_layers: int) -> list[RankLoad]:
    """Per pipeline rank (one entry without PP), as build_pipeline splits the model."""
    if p.pipeline_parallel_degree == 1:
        return [RankLoad(1, n_layers, True, True)]
    pp, per_rank = p.pipeline_parallel_degree, stages_per_rank(p, n_layers)
    split = layer_split(n_layers, pp * per_rank)
    loads = []
    for r in range(pp):
        ids = stage_ids(p.pipeline_parallel_schedule, r, pp, per_rank)
        loads.append(RankLoad(len(ids), sum(len(split[s]) for s in ids), 0 in ids, pp * per_rank - 1 in ids))
    return loads


def layer_split(n_layers: int, n_stages: int) -> list[range]:
    """Consecutive blocks per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append(range(start, end))
        start = end
    return bounds


def split_model(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_split(len(model.layers), n_stages)[stage]}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def schedule_class(name: str):
    return getattr(schedules, f"Schedule{name}")


class Stage(PipelineStage):
    """torch's PipelineStage, except that an MoE layer does not count its shape inference (one
    forward on stand-in inputs, inside the first step) as routed tokens: the load-balancing bias
    sees only the batch's (titan_exp.models.moe)."""

    def _forward_metadata_inference(self, *args, **kwargs):
        from titan_exp.models.moe import moe_layers

        layers = moe_layers([self.submod])
        for layer in layers:
            layer.counting = False
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for layer in layers:
                layer.counting = True


def build_pipeline(
    model: nn.Module,
    *,
    schedule: str,
    per_rank: int,
    pp_mesh,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prepare: Callable[[nn.Module], None],
):
    """(schedule, this rank's model parts, whether it holds the first stage, the last stage)."""
    pp = pp_mesh.size()
    pp_rank = pp_mesh.get_local_rank()
    n_stages = pp * per_rank
    ids = stage_ids(schedule, pp_rank, pp, per_rank)
    parts, stages = [], []
    for sid in ids:
        part = split_model(model, sid, n_stages)
        prepare(part)  # parallelize, materialize and initialise before the stage sees it
        parts.append(part)
        stages.append(Stage(part, sid, n_stages, device, group=pp_mesh.get_group()))
    cls = schedule_class(schedule)
    # Loss is already normalised by the step's token count, so gradients must not be rescaled.
    if schedule in SINGLE_STAGE:
        sched = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return sched, parts, 0 in ids, n_stages - 1 in ids
