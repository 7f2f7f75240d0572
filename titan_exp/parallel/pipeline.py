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
from typing import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules

from titan_exp.config import ParallelismConfig

SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED


def stages_per_rank(p: ParallelismConfig, n_layers: int) -> int:
    """From layers_per_stage if set (stages = n_layers / it, spread over the pp ranks), else
    stages_per_rank if set, else what the schedule needs: 1, or 2 for looped and V schedules."""
    if p.pipeline_parallel_layers_per_stage is not None:
        return n_layers // p.pipeline_parallel_layers_per_stage // p.pipeline_parallel_degree
    if p.pipeline_parallel_stages_per_rank is not None:
        return p.pipeline_parallel_stages_per_rank
    return 1 if p.pipeline_parallel_schedule in SINGLE_STAGE else 2


def stage_ids(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


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
        stages.append(PipelineStage(part, sid, n_stages, device, group=pp_mesh.get_group()))
    cls = schedule_class(schedule)
    # Loss is already normalised by the step's token count, so gradients must not be rescaled.
    if schedule in SINGLE_STAGE:
        sched = cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return sched, parts, 0 in ids, n_stages - 1 in ids
