"""Balanced pipeline stages: how many blocks each stage of a pipeline layout holds.

A pipeline splits its blocks over its stages as evenly as possible, the embedding counted as
`pipeline_parallel_first_stage_less_layers` blocks of the first stage and the output as
`pipeline_parallel_last_stage_less_layers` of the last (parallel.pipeline.layer_split). The ends
are not alike: the output projection and the loss (at a 128k vocabulary the FLOPs of 2.4 blocks
of Llama 3 8B) run on the last stage, the embedding's lookup costs next to nothing. The chooser
prices every split a valid pair of those two fields gives (pipeline.check accepts it, the stage
count kept) with the cost model (perf.model.step.stage_split_steps: the slowest rank's step, the
head on the last stage's; only the 8 splits with the shortest critical paths are priced whole),
and picks the fastest, of those predicted to fit in memory where a limit is given. The planner
chooses once a layout, at its first batch split (balanced_all), so a plan costs little more than
before. A job whose pair is set (either field not 0) keeps it: the user's split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan_exp.config import JobConfig
from titan_exp.parallel import dims as parallel_dims
from titan_exp.parallel import pipeline
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import stage_split_steps
from titan_exp.perf.rates.profile import MachineProfile
from titan_exp.perf.search.layouts import SPLIT_FIELDS

FIRST, LAST = "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"
# What the memory model is asked of, at most, before the fastest split is taken as it is: a layout
# none of whose splits fits is left to the planner's own memory check.
MEMORY_TRIES = 8


@dataclass(frozen=True)
class StageSplit:
    """A pair of the two fields, the blocks of each stage it gives, and its predicted step."""

    first_less: int
    last_less: int
    blocks: tuple[int, ...]
    step_s: float = 0.0


def user_set(job: JobConfig) -> bool:
    """Whether the job sets its own split (either field not 0): the planner keeps it."""
    p = job.parallelism
    return bool(getattr(p, FIRST) or getattr(p, LAST))


def with_pair(job: JobConfig, first_less: int, last_less: int) -> JobConfig:
    p = dataclasses.replace(job.parallelism, **{FIRST: first_less, LAST: last_less})
    return dataclasses.replace(job, parallelism=p)


def pairs(n_layers: int, stages: int, fixed_sum: int | None) -> list[tuple[int, int]]:
    """The pairs that can give distinct splits, fewest counted blocks first: for two stages one end
    at 0 (adding 1 to both gives the same split); else each end at most the blocks a middle stage
    can hold, plus one. With layers_per_stage set, only those of the job's sum (its stage count)."""
    if stages == 2:
        out = [(f, 0) for f in range(n_layers + 1)] + [(0, t) for t in range(1, n_layers + 1)]
    else:
        bound = n_layers // (stages - 2) + 1
        out = [(f, t) for f in range(bound + 1) for t in range(bound + 1)]
    if fixed_sum is not None:
        out = [(f, t) for f, t in out if f + t == fixed_sum]
    return sorted(out, key=lambda ft: (ft[0] + ft[1], ft[0]))


def candidate_splits(job: JobConfig, *, cuda: bool) -> list[tuple[StageSplit, list[pipeline.RankLoad]]]:
    """Every split of the job's blocks over its stages that a pair pipeline.check accepts gives,
    each once, with its smallest pair (the job's own first where it gives the split), and the
    loads it puts on the pipeline's ranks. Kept by what they depend on: a plan asks for the same
    pipeline's splits at every layout and batch split that has it."""
    p, n = job.parallelism, job.model.n_layers
    layout, _ = parallel_dims.check(job)
    if layout is None or p.pipeline_parallel_degree == 1:
        return []
    own = (getattr(p, FIRST), getattr(p, LAST))
    key = (n, p.pipeline_parallel_degree, p.pipeline_parallel_schedule, p.pipeline_parallel_layers_per_stage,
           p.pipeline_parallel_stages_per_rank, own, cuda)
    if key not in _SPLITS:
        _SPLITS[key] = _splits(job, layout, own, cuda)
    return _SPLITS[key]


_SPLITS: dict[tuple, list[tuple[StageSplit, list[pipeline.RankLoad]]]] = {}


def _splits(job: JobConfig, layout, own: tuple[int, int], cuda: bool) -> list[tuple[StageSplit, list]]:
    p, n = job.parallelism, job.model.n_layers
    stages = p.pipeline_parallel_degree * pipeline.stages_per_rank(p, n)
    fixed = sum(own) if p.pipeline_parallel_layers_per_stage is not None else None
    seen, out = set(), []
    for f, t in [own, *pairs(n, stages, fixed)]:
        blocks = tuple(len(r) for r in pipeline.layer_split(n, stages, f, t))
        if blocks in seen or min(blocks) < 0:
            continue
        candidate = with_pair(job, f, t)
        if not [e for e in pipeline.check(candidate, layout, cuda) if not e.startswith(SPLIT_FIELDS)]:
            seen.add(blocks)
            out.append((StageSplit(f, t, blocks), pipeline.rank_loads(candidate.parallelism, n)))
    return out


def priced_splits(job: JobConfig, profile: MachineProfile, *, cuda: bool) -> list[StageSplit]:
    """candidate_splits, each with its predicted step (infinite beyond the few with the shortest
    critical paths: perf.model.step.stage_split_steps), fastest first (ties: fewest blocks counted)."""
    splits = candidate_splits(job, cuda=cuda)
    steps = stage_split_steps(job, profile, [loads for _, loads in splits], cuda=cuda) if splits else []
    priced = [dataclasses.replace(split, step_s=step) for (split, _), step in zip(splits, steps)]
    return sorted(priced, key=lambda s: (round(s.step_s, 9), s.first_less + s.last_less, s.first_less))


def choose(job: JobConfig, profile: MachineProfile, *, cuda: bool,
           memory_gib: float = float("inf")) -> StageSplit | None:
    """The fastest predicted split of the job's pipeline that is predicted to fit in `memory_gib`
    (the fastest, where none of the first MEMORY_TRIES does); None without PP or where the job
    sets its own split."""
    if job.parallelism.pipeline_parallel_degree == 1 or user_set(job):
        return None
    priced = priced_splits(job, profile, cuda=cuda)
    if not priced or memory_gib == float("inf"):
        return priced[0] if priced else None
    fits = (s for s in priced[:MEMORY_TRIES]
            if predict_memory(with_pair(job, s.first_less, s.last_less), cuda=cuda)["total"] <= memory_gib)
    return next(fits, priced[0])


def balanced(job: JobConfig, profile: MachineProfile, *, cuda: bool, memory_gib: float = float("inf")) -> JobConfig:
    """`job` with its pipeline's stages balanced (choose); as it is without PP or with its own split."""
    return balanced_all([job], profile, cuda=cuda, memory_gib=memory_gib)[0]


def balanced_all(jobs: list[JobConfig], profile: MachineProfile, *, cuda: bool,
                 memory_gib: float = float("inf")) -> list[JobConfig]:
    """Jobs of one layout (its batch splits) with the split the first's balance chooses: the
    slowest stage is the same stage at every batch split, so the stages are chosen once a layout."""
    if not jobs:
        return jobs
    chosen = choose(jobs[0], profile, cuda=cuda, memory_gib=memory_gib)
    return jobs if chosen is None else [with_pair(j, chosen.first_less, chosen.last_less) for j in jobs]
