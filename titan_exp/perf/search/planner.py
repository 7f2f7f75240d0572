"""The layout planner: every valid layout of a model on N devices (search.layouts), each at every
combination of the other axes `autotune.search` names (AC mode, compile, precision, float8's shape
filter: search.axes), with its predicted step time, tokens/s and memory per device (perf.model),
ranked. Without measuring, this is what autotune predicts; `python -m titan_exp.perf.plan` prints it,
and cluster.elastic re-plans with `fastest_fitting`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from titan_exp.config import MESH_DIMS, AutotuneAxis, JobConfig, layout_label
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.placement import across_nodes
from titan_exp.perf.model.step import StepPrediction, predict_step
from titan_exp.perf.rates.profile import MachineProfile, this_machine
from titan_exp.perf.search.axes import labels, variants
from titan_exp.perf.search.layouts import (
    batch_splits,
    degrees_of,
    factorizations,
    global_batch_of,
    layout_overrides,
    split_jobs,
    split_label,
    valid_layouts,
)
from titan_exp.perf.search.stages import balanced, balanced_all
from titan_exp.validation import resolve, validate


@dataclass
class Plan:
    degrees: dict[str, int]
    local_batch_size: int
    split: str  # split_label: local batch, accumulation, PP microbatch
    overrides: list[str]
    memory_gib: float
    parts_gib: dict[str, float]
    step: StepPrediction
    fits: bool = True
    across_nodes: tuple[str, ...] = ()  # mesh dims (and "ep") whose groups span nodes (model.placement.across_nodes)
    nodes: int = 1  # the nodes its ranks span (cluster.nnodes)
    settings: tuple[str, ...] = ()  # the overrides of the other axes searched (perf.search.axes.variants)
    configured: bool = True  # those settings are the job's own
    job: JobConfig | None = None  # the candidate as planned (write_sweep writes its settings from it)

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens/s per device."""
        return self.step.tokens_per_s_per_device

    @property
    def name(self) -> str:
        return ", ".join([layout_label(self.degrees), *labels(self.settings)])


def fastest(jobs: list[JobConfig], profile: MachineProfile, *, cuda: bool, memory_gib: float) -> JobConfig | None:
    """The fastest predicted of `jobs` among those that fit in memory, else the fastest. Memory is
    predicted first, so the step is predicted only for those that fit (for all when none does)."""
    fits = [j for j in jobs if predict_memory(j, cuda=cuda)["total"] <= memory_gib] or jobs
    return min(fits, key=lambda j: predict_step(j, profile, cuda=cuda).step_s, default=None)


def best_split_layouts(job: JobConfig, world: int, profile: MachineProfile, *, cuda: bool = False,
                       memory_gib: float = float("inf")) -> list[JobConfig]:
    """Every layout of `world` devices, each at its fastest predicted split of the job's global
    batch (batch_splits): a layout is not left out for want of a local batch or microbatch the
    user did not ask for. A pipeline's stages are balanced (perf.search.stages), once a layout."""
    global_batch = global_batch_of(job, world)
    best = (fastest(balanced_all(batch_splits(job, degrees, global_batch, cuda=cuda), profile, cuda=cuda,
                                 memory_gib=memory_gib), profile, cuda=cuda, memory_gib=memory_gib)
            for degrees in factorizations(world, job.model.n_experts))
    return [j for j in best if j is not None]


@dataclass
class Replan:
    """The planner's answer for an elastic run (fastest_fitting): the job in the chosen layout, or
    None when no layout fits; and then, for the refusal, how many layouts validate and which needs
    the least memory."""

    job: JobConfig | None
    least_gib: float = float("inf")
    least_layout: str = ""
    valid: int = 0  # where none fits: the layouts that validate (at their fastest split)
    step_s: float = 0.0  # the chosen layout's predicted seconds per step
    memory_gib: float = 0.0  # and its predicted memory per device


def fastest_fitting(job: JobConfig, world: int, *, cuda: bool, memory_gib: float,
                    profile: MachineProfile | None = None) -> Replan:
    """The fastest predicted layout of `world` devices that fits in `memory_gib` per device, at
    the job's global batch (each layout at its fastest split, gradient accumulation absorbing
    what the local batch cannot hold), with the job's model, precision, AC and compile. Every split
    of every layout is priced, and only one predicted faster than the fastest that fits so far is
    validated and its memory predicted: the answer is the search's over every valid split (a split
    the validator refuses is never chosen), at little more than the cost of the step predictions."""
    profile = profile or this_machine(world, cuda=cuda, nodes=job.cluster.nodes_for(world))
    global_batch, best = global_batch_of(job, world), None
    for degrees in factorizations(world, job.model.n_experts):
        splits = balanced_all(split_jobs(job, degrees, global_batch, cuda=cuda), profile, cuda=cuda,
                              memory_gib=memory_gib)  # a pipeline's stages balanced, once a layout
        for split in splits:
            candidate = resolve(split)
            step_s = predict_step(candidate, profile, cuda=cuda).step_s
            if (best is not None and step_s >= best[0]) or validate(split, cuda=cuda):
                continue
            gib = predict_memory(candidate, cuda=cuda)["total"]
            if gib <= memory_gib:
                best = step_s, gib, candidate
    if best is None:
        return none_fits(job, world, profile, cuda=cuda)
    return Replan(best[2], step_s=best[0], memory_gib=best[1])


def none_fits(job: JobConfig, world: int, profile: MachineProfile, *, cuda: bool) -> Replan:
    """Where no layout of `world` devices fits: how many validate, and of them (each at its fastest
    split) the one that needs the least memory."""
    layouts = best_split_layouts(job, world, profile, cuda=cuda)
    if not layouts:
        return Replan(None)
    memory = [predict_memory(j, cuda=cuda)["total"] for j in layouts]
    least = min(range(len(layouts)), key=memory.__getitem__)
    return Replan(None, memory[least], layout_label(degrees_of(layouts[least])), len(layouts))


def plan(job: JobConfig, world: int, *, device_memory_gib: float, cuda: bool = False,
         profile: MachineProfile | None = None, any_split: bool = False,
         axes: Iterable[AutotuneAxis] = ()) -> list[Plan]:
    """Every valid layout, fastest first among those that fit, then those that do not; at the
    job's local batch, or with `any_split` each at its fastest split of the global batch; each
    at every combination of the values of the other `axes` searched (perf.search.axes.variants);
    each pipeline with its stages balanced (perf.search.stages), unless the job sets their split."""
    nodes = job.cluster.nodes_for(world)
    profile = profile or this_machine(world, cuda=cuda, nodes=nodes)
    plans = []
    for variant, settings in variants(job, axes, cuda=cuda):
        own = (variant.activation_checkpoint, variant.compile, variant.precision) == (
            job.activation_checkpoint, job.compile, job.precision)
        layouts = (best_split_layouts(variant, world, profile, cuda=cuda, memory_gib=device_memory_gib) if any_split
                   else [balanced(j, profile, cuda=cuda, memory_gib=device_memory_gib)
                         for j in valid_layouts(variant, world, cuda=cuda)])
        plans += [plan_of(candidate, profile, cuda=cuda, device_memory_gib=device_memory_gib, settings=settings,
                          configured=own) for candidate in layouts]
    return sorted(plans, key=lambda pl: (not pl.fits, -pl.tokens_per_s))


def plan_of(candidate: JobConfig, profile: MachineProfile, *, cuda: bool, device_memory_gib: float,
            settings: Iterable[str] = (), configured: bool = True) -> Plan:
    """One candidate job (a layout at a batch split, with `settings` of the other axes searched) as
    a ranked row: its predicted step and memory, and whether it fits."""
    parts = predict_memory(candidate, cuda=cuda)
    return Plan(degrees_of(candidate), candidate.training.local_batch_size, split_label(candidate),
                layout_overrides(candidate), parts["total"], {k: v for k, v in parts.items() if k != "total"},
                predict_step(candidate, profile, cuda=cuda), fits=parts["total"] <= device_memory_gib,
                across_nodes=tuple(d for d in (*MESH_DIMS, "ep") if d in across_nodes(candidate)),
                nodes=candidate.cluster.nnodes, settings=tuple(settings), configured=configured, job=candidate)


def device_memory_gib(world: int, cuda: bool) -> float:
    """Memory per device when not given: this GPU's, or this machine's RAM shared by the ranks."""
    import os

    import torch

    if cuda and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world
