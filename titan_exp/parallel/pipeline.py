"""Pipeline parallel with `torch.distributed.pipelining`.

The model (still on the meta device) is cut into pp * stages_per_rank stages of consecutive
blocks; the first stage keeps the embedding, the last the final norm and output. The split is as
even as possible, counting the embedding as pipeline_parallel_first_stage_less_layers blocks and
the output as pipeline_parallel_last_stage_less_layers (TorchTitan's options): Llama 3.1 405B's
126 blocks over 128 stages, say, one stage holding only the embedding and one only the output.
Stages are copies of the whole model with the other modules deleted, so every parameter keeps its
fully qualified name. Ranks hold one stage (GPipe, 1F1B), several in a loop (rank r holds r, r+pp,
...: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) or two in a V (rank r holds r and
2pp-1-r: ZBVZeroBubble, DualPipeV). Tied embeddings: the last stage holds a copy of the embedding
as its output weight, kept equal to it (sum_tied_grads).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from titan_exp.config import JobConfig, ParallelismConfig, PipelineSchedule, problem

# The schedules (PipelineSchedule, in the schema) by how many stages a rank holds.
SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
assert {s.value for s in PipelineSchedule} == set(SINGLE_STAGE + LOOPED + V_SHAPED)


def split_layers(p: ParallelismConfig, n_layers: int) -> int:
    """The blocks a pipeline splits: the model's, and its ends counted as blocks (the embedding as
    first_stage_less_layers of them, the output as last_stage_less_layers)."""
    return n_layers + p.pipeline_parallel_first_stage_less_layers + p.pipeline_parallel_last_stage_less_layers


def stages_per_rank(p: ParallelismConfig, n_layers: int) -> int:
    """From layers_per_stage if set (stages = split_layers / it, spread over the pp ranks), else
    stages_per_rank if set, else what the schedule needs: 1, or 2 for looped and V schedules."""
    if p.pipeline_parallel_layers_per_stage is not None:
        return split_layers(p, n_layers) // p.pipeline_parallel_layers_per_stage // p.pipeline_parallel_degree
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
    first, last = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
    n_split = split_layers(p, m.n_layers)
    counted = f"model.n_layers = {m.n_layers}" + (f" + the ends' {first} + {last} = {n_split}" if first or last else "")
    if lps is not None:
        if lps < 1 or n_split % lps:
            return [problem("parallelism.pipeline_parallel_layers_per_stage", lps, f"must divide {counted}")]
        if (n_split // lps) % dims.pp:
            return [problem("parallelism.pipeline_parallel_layers_per_stage", lps,
                            f"gives {n_split // lps} stages, not a multiple of pipeline_parallel_degree = {dims.pp}")]
        spr = p.pipeline_parallel_stages_per_rank
        if spr is not None and spr != n_split // lps // dims.pp:
            return [problem("parallelism.pipeline_parallel_stages_per_rank", spr,
                            f"contradicts layers_per_stage = {lps} ({n_split // lps // dims.pp} per rank); "
                            "set only one")]
    per_rank = stages_per_rank(p, m.n_layers)
    if sched in SINGLE_STAGE and per_rank != 1:
        e.append(problem("parallelism.pipeline_parallel_stages_per_rank", per_rank,
                         f"{sched} runs one stage per rank; set it to 1 (or null) or pick a looped schedule"))
    if sched in V_SHAPED and per_rank != 2:
        e.append(problem("parallelism.pipeline_parallel_stages_per_rank", per_rank, f"{sched} needs exactly 2 (a V)"))
    if sched in LOOPED and per_rank < 2:
        e.append(problem("parallelism.pipeline_parallel_stages_per_rank", per_rank,
                         f"{sched} needs >= 2 stages per rank"))
    stages = dims.pp * per_rank
    if stages > n_split:
        fix = ("" if first or last or stages > m.n_layers + 2 else "; or count the embedding and the output as blocks "
               "(parallelism.pipeline_parallel_first_stage_less_layers=1, pipeline_parallel_last_stage_less_layers=1)")
        e.append(problem("parallelism.pipeline_parallel_degree", dims.pp,
                         f"{dims.pp} ranks x {per_rank} stages = {stages} stages but {counted}; every stage needs "
                         f"a block or one of the model's ends{fix}"))
    else:
        even = n_split // stages  # the fewest blocks a stage is given, its ends counted
        for name, less in (("first", first), ("last", last)):
            if less > even:
                e.append(problem(f"parallelism.pipeline_parallel_{name}_stage_less_layers", less,
                                 f"is more than the {even} blocks each of the {stages} stages is given ({counted}); "
                                 f"lower it to at most {even}"))
    mbs = p.pipeline_parallel_microbatch_size
    if t.local_batch_size % mbs:
        e.append(problem("parallelism.pipeline_parallel_microbatch_size", mbs,
                         f"must divide training.local_batch_size = {t.local_batch_size}"))
    else:
        n_mb = t.local_batch_size // mbs
        if sched not in SINGLE_STAGE and n_mb % dims.pp:
            e.append(problem("training.local_batch_size", t.local_batch_size,
                             f"{sched} needs the microbatch count ({n_mb}) to be a multiple of "
                             f"pipeline_parallel_degree = {dims.pp}; raise local_batch_size or lower "
                             "pipeline_parallel_microbatch_size"))
        elif n_mb < dims.pp:
            e.append(problem("training.local_batch_size", t.local_batch_size,
                             f"gives {n_mb} microbatches for {dims.pp} pipeline ranks; need at least one per rank"))
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


def stage_split(p: ParallelismConfig, n_layers: int) -> list[range]:
    """The blocks of each of the pipeline's stages (pp x stages_per_rank of them)."""
    stages = p.pipeline_parallel_degree * stages_per_rank(p, n_layers)
    return layer_split(n_layers, stages, p.pipeline_parallel_first_stage_less_layers,
                       p.pipeline_parallel_last_stage_less_layers)


def rank_loads(p: ParallelismConfig, n_layers: int) -> list[RankLoad]:
    """Per pipeline rank (one entry without PP), as build_pipeline splits the model."""
    if p.pipeline_parallel_degree == 1:
        return [RankLoad(1, n_layers, True, True)]
    pp, per_rank = p.pipeline_parallel_degree, stages_per_rank(p, n_layers)
    split = stage_split(p, n_layers)
    loads = []
    for r in range(pp):
        ids = stage_ids(p.pipeline_parallel_schedule, r, pp, per_rank)
        loads.append(RankLoad(len(ids), sum(len(split[s]) for s in ids), 0 in ids, pp * per_rank - 1 in ids))
    return loads


def layer_split(n_layers: int, n_stages: int, first_less: int = 0, last_less: int = 0) -> list[range]:
    """Consecutive blocks per stage, as even as possible (earlier stages take the remainder), the
    embedding counted as `first_less` blocks of the first stage and the output as `last_less` of
    the last (check refuses an end counted as more than a stage is given)."""
    base, extra = divmod(n_layers + first_less + last_less, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0) - (first_less if s == 0 else 0) - (last_less if s == n_stages - 1 else 0)
        bounds.append(range(start, start + size))
        start += size
    return bounds


def split_model(model: nn.Module, stage: int, split: list[range]) -> nn.Module:
    """Stage `stage` of `split`: a copy of the model with the other stages' blocks deleted, the
    embedding kept on the first stage only, the final norm and output on the last only."""
    n_stages = len(split)
    part = copy.deepcopy(model)
    keep = {str(i) for i in split[stage]}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != n_stages - 1:
        part.norm = None
        part.output = None
    return part


def tied_copy(part: nn.Module) -> nn.Parameter | None:
    """The output weight of a last stage whose model ties it to the embedding: a Parameter of its
    own (the embedding is on the first stage), drawn as the embedding (Transformer.init_weights).
    Only a stage split_model cut has no embedding: any other model (a class of the user's) has none."""
    if getattr(part, "tok_embeddings", ...) is None and part.output is not None and part.cfg.tie_word_embeddings:
        return part.output.weight
    return None


@torch.no_grad()
def sum_tied_grads(parts: list[nn.Module], pp_group) -> list[nn.Parameter]:
    """Tied embeddings under PP: the first stage's embedding and the last stage's copy of it
    (tied_copy) each hold their own stage's gradient; both get the sum, one process's gradient of
    the one matrix, so both take the same update and stay equal. The two stages are on one rank
    (a V: rank 0) or on the pipeline's first and last rank, which swap gradients (their local
    shards: FSDP and TP shard both alike, Shard(0) over the vocabulary). Returns this rank's copy,
    which the gradient norm leaves out, so the matrix counts once (train.optim.clip_grad_norm_)."""
    if pp_group is None or not parts[0].cfg.tie_word_embeddings:
        return []
    embedding = next((part.tok_embeddings.weight for part in parts if part.tok_embeddings is not None), None)
    copy_ = next((p for p in map(tied_copy, parts) if p is not None), None)
    grads = [local_grad(p) for p in (embedding, copy_) if p is not None]
    if len(grads) == 2:
        grads[0].add_(grads[1])
        grads[1].copy_(grads[0])
    elif grads:
        peer = dist.get_global_rank(pp_group, 0 if embedding is None else dist.get_world_size(pp_group) - 1)
        mine, theirs = grads[0].contiguous(), torch.empty_like(grads[0], memory_format=torch.contiguous_format)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, pp_group),
                                            dist.P2POp(dist.irecv, theirs, peer, pp_group)]):
            work.wait()
        grads[0].add_(theirs)  # a + b == b + a in floating point: both ranks hold the same sum
    return [copy_] if copy_ is not None else []


def local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's shard of `param`'s gradient, laid out as `param` is: under TP alone the
    embedding's gradient comes back replicated, its weight row-sharded (it becomes this rank's rows)."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != param.placements:
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()


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
    split: list[range],
    pp_mesh,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prepare: Callable[[nn.Module], None],
):
    """(schedule, this rank's model parts, whether it holds the first stage, the last stage), the
    model cut into `split`'s stages (stage_split)."""
    pp = pp_mesh.size()
    pp_rank = pp_mesh.get_local_rank()
    n_stages = len(split)
    ids = stage_ids(schedule, pp_rank, pp, n_stages // pp)
    parts, stages = [], []
    for sid in ids:
        part = split_model(model, sid, split)
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
