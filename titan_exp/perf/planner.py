"""The layout planner: every valid layout of a model on N devices, with predicted step time,
tokens/s per device and memory per device, ranked; optionally written out as a sweep preset.
`python -m titan_exp.perf.plan` is its command (titan_exp.perf.plan). With the axes
`autotune.search` names besides the layout (AC mode, compile, precision, float8's shape filter:
titan_exp.perf.search), each layout at each combination of their values: the candidates autotune
predicts, ranked without measuring.

"Valid" is decided by titan_exp.validation, the same check the launcher runs, so a planned
layout never fails at launch. Time comes from titan_exp.perf.step with this machine's calibrated
profile (`python -m titan_exp.perf.calibrate --world N`), or round-number defaults, which the output
says, with how far off the defaults were the last time they were checked against real runs.
Memory comes from titan_exp.perf.memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from titan_exp.config import (LAYOUT_FIELDS, MESH_DIMS, AutotuneAxis, JobConfig, ParallelismConfig, layout_label,
                              user_sweeps, world_of)
from titan_exp.perf.devices import SPEC_ACCURACY
from titan_exp.perf.memory import predict_memory
from titan_exp.perf.profile import MachineProfile, accuracy_kind, last_accuracy, this_machine
from titan_exp.perf.placement import across_nodes
from titan_exp.perf.search import labels, override_key, variants
from titan_exp.perf.step import StepPrediction, predict_step
from titan_exp.validation import resolve, validate

__all__ = ["Plan", "Replan", "fastest_fitting", "plan", "predict_memory", "valid_layouts", "with_layout",
           "layout_overrides", "write_sweep"]


def degrees_of(job: JobConfig) -> dict[str, int]:
    """The job's layout: its mesh degrees, and ep when expert parallel is on."""
    return job.parallelism.layout


def layout_overrides(job: JobConfig) -> list[str]:
    """The overrides that give another job this job's layout and batch split: its local batch and,
    under PP, its microbatch (for an MoE model, its expert parallel degree too, 1 included)."""
    layout = degrees_of(job) | ({"ep": job.parallelism.expert_parallel_degree} if job.model.is_moe else {})
    p = job.parallelism
    microbatch = ([f"parallelism.pipeline_parallel_microbatch_size={p.pipeline_parallel_microbatch_size}"]
                  if p.pipeline_parallel_degree > 1 else [])
    return [f"parallelism.{LAYOUT_FIELDS[dim]}={d}" for dim, d in layout.items()] + [
        f"training.local_batch_size={job.training.local_batch_size}", *microbatch]


def split_label(job: JobConfig) -> str:
    """How a job splits its global batch: the local batch, its accumulation steps, the PP microbatch."""
    t, p, accumulation = job.training, job.parallelism, job.accumulation
    out = f"local batch {t.local_batch_size}" + (f" x {accumulation} accumulated" if accumulation > 1 else "")
    return out + (f", microbatch {p.pipeline_parallel_microbatch_size}" if p.pipeline_parallel_degree > 1 else "")


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
    across_nodes: tuple[str, ...] = ()  # mesh dims (and "ep") whose groups span nodes (perf.placement.across_nodes)
    nodes: int = 1  # the nodes its ranks span (cluster.nnodes)
    settings: tuple[str, ...] = ()  # the overrides of the other axes searched (perf.search.variants)
    configured: bool = True  # those settings are the job's own
    job: JobConfig | None = None  # the candidate as planned (write_sweep writes its settings from it)

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens/s per device."""
        return self.step.tokens_per_s_per_device

    @property
    def name(self) -> str:
        return ", ".join([layout_label(self.degrees), *labels(self.settings)])


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


def factorizations(world: int, n_experts: int = 0) -> list[dict[str, int]]:
    """Every assignment of degrees to the five mesh dims whose product is `world`; for an MoE
    model (`n_experts` > 0) each also with every expert parallel degree that divides the experts
    and dp_shard x cp x tp (validation decides which of those can be carved)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for pp, rep, shard, cp in itertools.product(divisors, repeat=4):
        rest = pp * rep * shard * cp
        if world % rest == 0:
            degrees = dict(zip(MESH_DIMS, (pp, rep, shard, cp, world // rest)))
            out.append(degrees)
            carved = shard * cp * degrees["tp"]
            out += [degrees | {"ep": ep} for ep in range(2, carved + 1) if n_experts % ep == 0 and carved % ep == 0]
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
        why = (f"training.local_batch_size {t.local_batch_size} x {dp} data-parallel rank{'s' if dp > 1 else ''} of the "
               f"configured layout, {layout_label(configured_layout(job, world))}")
    else:
        why = (f"training.local_batch_size {t.local_batch_size} on each of the {world} devices: the configured "
               f"degrees ({layout_label(p.layout)}) do not multiply to {world}")
    return f"every layout at a global batch of {global_batch_of(job, world):,} sequences ({why})"


def valid_layouts(job: JobConfig, world: int, *, cuda: bool = False) -> list[JobConfig]:
    """Every layout of `world` devices that validates at the job's global batch and its local
    batch (or the largest below it that divides the global batch)."""
    global_batch = global_batch_of(job, world)
    jobs = (with_layout(job, degrees, global_batch) for degrees in factorizations(world, job.model.n_experts))
    return [resolve(j) for j in jobs if not validate(j, cuda=cuda)]


# The fields a batch split sets, as validation's messages name them (`field = value: ...`).
SPLIT_FIELDS = ("training.local_batch_size", "training.global_batch_size", "parallelism.pipeline_parallel_microbatch_size")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def batch_splits(job: JobConfig, degrees: dict[str, int], global_batch: int, *, cuda: bool = False) -> list[JobConfig]:
    """The job with these degrees at every split of `global_batch` that validates: each local batch
    that divides a rank's share (the rest accumulates) and, under PP, each microbatch that divides
    the local batch."""
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if global_batch % dp:
        return []
    # A layout refused for anything but its split is refused at every split.
    if any(not e.startswith(SPLIT_FIELDS) for e in validate(with_layout(job, degrees, global_batch), cuda=cuda)):
        return []
    jobs = (with_layout(job, degrees, global_batch, local_batch_size=local, microbatch_size=microbatch)
            for local in divisors(global_batch // dp)
            for microbatch in (divisors(local) if degrees["pp"] > 1 else [None]))
    return [resolve(j) for j in jobs if not validate(j, cuda=cuda)]


def fastest(jobs: list[JobConfig], profile: MachineProfile, *, cuda: bool, memory_gib: float) -> JobConfig | None:
    """The fastest predicted of `jobs` among those that fit in memory, else the fastest."""
    def key(j: JobConfig) -> tuple[bool, float]:
        return predict_memory(j, cuda=cuda)["total"] > memory_gib, predict_step(j, profile, cuda=cuda).step_s

    return min(jobs, key=key, default=None)


def best_split_layouts(job: JobConfig, world: int, profile: MachineProfile, *, cuda: bool = False,
                       memory_gib: float = float("inf")) -> list[JobConfig]:
    """Every layout of `world` devices, each at its fastest predicted split of the job's global
    batch (batch_splits): a layout is not left out for want of a local batch or microbatch the
    user did not ask for."""
    global_batch = global_batch_of(job, world)
    best = (fastest(batch_splits(job, degrees, global_batch, cuda=cuda), profile, cuda=cuda, memory_gib=memory_gib)
            for degrees in factorizations(world, job.model.n_experts))
    return [j for j in best if j is not None]


@dataclass
class Replan:
    """The planner's answer for an elastic run (fastest_fitting): the job in the chosen layout, or
    None when no layout fits; and the layout that needs the least memory, for the refusal."""

    job: JobConfig | None
    least_gib: float = float("inf")
    least_layout: str = ""
    valid: int = 0  # layouts that validate (at their fastest split)
    step_s: float = 0.0  # the chosen layout's predicted seconds per step
    memory_gib: float = 0.0  # and its predicted memory per device


def fastest_fitting(job: JobConfig, world: int, *, cuda: bool, memory_gib: float,
                    profile: MachineProfile | None = None) -> Replan:
    """The fastest predicted layout of `world` devices that fits in `memory_gib` per device, at
    the job's global batch (each layout at its fastest split, gradient accumulation absorbing
    what the local batch cannot hold), with the job's model, precision, AC and compile."""
    profile = profile or this_machine(world, cuda=cuda, nodes=job.cluster.nodes_for(world))
    layouts = best_split_layouts(job, world, profile, cuda=cuda, memory_gib=memory_gib)
    if not layouts:
        return Replan(None)
    memory = [predict_memory(j, cuda=cuda)["total"] for j in layouts]
    least = min(range(len(layouts)), key=memory.__getitem__)
    answer = Replan(None, memory[least], layout_label(degrees_of(layouts[least])), len(layouts))
    fits = [(predict_step(j, profile, cuda=cuda).step_s, m, j) for j, m in zip(layouts, memory) if m <= memory_gib]
    if not fits:
        return answer
    step_s, gib, best = min(fits, key=lambda f: f[0])
    return dataclasses.replace(answer, job=best, step_s=step_s, memory_gib=gib)


def settings_config(job: JobConfig, settings: Iterable[str]) -> dict[str, Any]:
    """What a candidate's settings set, as config to merge into a job's: each `section.field=value`
    as that value, and a precision preset (`precision=NAME`) as the whole precision config the
    candidate was predicted with (perf.search.with_preset), so no field of another preset stays."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for setting in settings:
        key, value = override_key(setting), setting.split("=", 1)[1]
        if key == "precision":
            out["precision"] = OmegaConf.to_container(OmegaConf.structured(job.precision), enum_to_str=True)
        else:
            section, name = key.split(".")
            out.setdefault(section, {})[name] = yaml.safe_load(value)
    return out


def plan(job: JobConfig, world: int, *, device_memory_gib: float, cuda: bool = False,
         profile: MachineProfile | None = None, any_split: bool = False,
         axes: Iterable[AutotuneAxis] = ()) -> list[Plan]:
    """Every valid layout, fastest first among those that fit, then those that do not; at the
    job's local batch, or with `any_split` each at its fastest split of the global batch; each
    at every combination of the values of the other `axes` searched (perf.search.variants)."""
    nodes = job.cluster.nodes_for(world)
    profile = profile or this_machine(world, cuda=cuda, nodes=nodes)
    plans = []
    for variant, settings in variants(job, axes, cuda=cuda):
        own = (variant.activation_checkpoint, variant.compile, variant.precision) == (
            job.activation_checkpoint, job.compile, job.precision)
        layouts = (best_split_layouts(variant, world, profile, cuda=cuda, memory_gib=device_memory_gib) if any_split
                   else valid_layouts(variant, world, cuda=cuda))
        for candidate in layouts:
            parts = predict_memory(candidate, cuda=cuda)
            plans.append(Plan(degrees_of(candidate), candidate.training.local_batch_size, split_label(candidate),
                              layout_overrides(candidate),
                              parts["total"], {k: v for k, v in parts.items() if k != "total"},
                              predict_step(candidate, profile, cuda=cuda), fits=parts["total"] <= device_memory_gib,
                              across_nodes=tuple(d for d in (*MESH_DIMS, "ep") if d in across_nodes(candidate)),
                              nodes=candidate.cluster.nnodes, settings=tuple(settings), configured=own,
                              job=candidate))
    return sorted(plans, key=lambda pl: (not pl.fits, -pl.tokens_per_s))


def configured_line(job: JobConfig, world: int, plans: list[Plan], profile: MachineProfile, *,
                    device_memory_gib: float, cuda: bool = False) -> str:
    """The job as configured (its layout and batch split) beside the plans: its predicted tokens/s
    and memory, where its layout ranks, and how much faster the fastest is predicted (where it does
    not fit, the fastest that does); or why it is refused, or is not a layout of `world` ranks."""
    p = job.parallelism
    if not p.lays_out(world):
        return unlaid_line(p, world)
    mine = with_layout(job, configured_layout(job, world), global_batch_of(job, world),
                       local_batch_size=job.training.local_batch_size,
                       microbatch_size=p.pipeline_parallel_microbatch_size if p.pipeline_parallel_degree > 1 else None)
    label = layout_label(degrees_of(mine))
    errors = validate(mine, cuda=cuda)
    if errors:
        return f"your configuration ({label}, {split_label(mine)}) is refused on {world} devices: {errors[0]}"
    mine = resolve(mine)
    step, gib = predict_step(mine, profile, cuda=cuda), predict_memory(mine, cuda=cuda)["total"]
    fits = gib <= device_memory_gib
    out = (f"your configuration ({label}, {split_label(mine)}): {step.tokens_per_s_per_device:,.0f} tokens/s/device, "
           f"{gib:.2f} GiB/device{'' if fits else ' (does NOT fit)'}")
    rank = next((i for i, pl in enumerate(plans, 1) if pl.degrees == degrees_of(mine) and pl.configured), None)
    if rank is not None:
        own = plans[rank - 1]
        at = "" if own.split == split_label(mine) else f" at {own.split}, {own.tokens_per_s:,.0f} tokens/s/device"
        what = "its layout at its own settings ranks" if own.settings else "its layout ranks"
        out += f"; {what} {rank} of {len(plans)}{at}"
    best = plans[0] if plans and plans[0].fits else None
    if best is not None and not fits:
        out += f"; the fastest that fits, {best.name} ({best.split}), {best.tokens_per_s:,.0f} tokens/s/device"
    elif best is not None and rank != 1:
        out += (f"; the fastest, {best.name} ({best.split}), is predicted "
                f"{best.tokens_per_s / step.tokens_per_s_per_device - 1:+.0%}")
    return out


def unlaid_line(p: ParallelismConfig, world: int) -> str:
    """Why the configured degrees are not ranked on `world` ranks, and the field that would make them
    a layout of them."""
    label, known = layout_label(p.layout), p.known_degree
    if world % known:
        fix = (f"its degrees other than data_parallel_shard_degree multiply to {known}, which does not divide "
               f"{world}; pick degrees whose product divides it")
    else:
        fix = (f"with parallelism.data_parallel_shard_degree = {p.data_parallel_shard_degree} they multiply to "
               f"{known * p.dp_shard_at(world)}; set it to -1 (or {world // known}) to shard data over all {world}")
    return f"your configuration ({label}) is not a layout of {world} devices, so it is not ranked: {fix}"


def margin_line(plans: list[Plan], device_memory_gib: float) -> str | None:
    """On GPUs: where the fastest plan that fits leaves less memory to spare than the memory model's
    worst error on held-out published GPU runs (SPEC_ACCURACY's memory), a line that says so and
    names the fastest plan that leaves that margin."""
    best = next((pl for pl in plans if pl.fits), None)
    rows, _, worst = SPEC_ACCURACY["memory"]
    limit = (1 - worst) * device_memory_gib
    if best is None or best.memory_gib <= limit:
        return None
    out = (f"{best.name} ({best.split}) is predicted at {best.memory_gib:.2f} of {device_memory_gib:.2f} GiB/device, "
           f"closer to the limit than the memory model's worst error on {rows} held-out published GPU runs "
           f"({worst:.0%}), and the CUDA context is not counted: it may not fit")
    safe = next((pl for pl in plans if pl.memory_gib <= limit), None)
    if safe is None:
        return out + f"; no layout is predicted under {limit:.2f} GiB"
    return (out + f"; the fastest under {limit:.2f} GiB, {safe.name} ({safe.split}), "
            f"{safe.tokens_per_s:,.0f} tokens/s/device ({safe.tokens_per_s / best.tokens_per_s - 1:+.0%})")


def profile_line(profile: MachineProfile) -> str:
    """Which profile the times come from, or that they are the defaults and how wrong those were."""
    if profile.source == "spec":
        seen = SPEC_ACCURACY
        device = profile.key.get("device")
        runs, signed, size = seen["by_device"].get(device, (0, 0.0, 0.0))
        median_run = ("as measured" if abs(signed) < 0.005
                      else f"{abs(signed):.0%} too {'slow' if signed < 0 else 'fast'}")
        own = (f"; on {device}'s sheet alone ({runs} run{'s' if runs > 1 else ''}) {size:.0%} at the median, the "
               f"median run predicted {median_run}" if runs else "")
        return (f"times PREDICTED FROM A SPEC SHEET ({profile.notes[0] if profile.notes else profile.name}); held out "
                f"against {seen['rows']} published GPU runs ({seen['date']}, benchmarks/bench_published.py) such "
                f"plans' tokens/s erred {seen['median_abs_error']:.0%} at the median and ordered "
                f"{seen['pairs_ordered'][0]} of {seen['pairs_ordered'][1]} pairs of layouts on one machine as "
                f"measured{own}; calibrate on the GPU to replace it with measured costs")
    if profile.source == "defaults":
        seen = last_accuracy(accuracy_kind(profile))
        how = (f"the last check against {seen['runs']} real runs ({seen['when']}) found a median error of "
               f"{seen['median_abs_error']:.0%}" if seen else "never checked against real runs on this machine")
        return (f"times from DEFAULT costs (no profile for this machine and world size: run python -m "
                f"titan_exp.perf.calibrate --world {profile.key['world']}); {how}")
    c = profile.corrections
    fitted = f", refit to {c.measurements} measured runs" if c.measurements else ""
    return f"times predicted from the measured machine profile {profile.name} ({profile.created}{fitted})"


def to_markdown(plans: list[Plan], world: int, device_memory_gib: float, valid: int | None = None) -> str:
    """The plans as a table, of `valid` layouts (all of them: `plans`, unless only the top are
    shown); times are seconds per step, by part (perf.step.BREAKDOWN)."""
    nodes = any(pl.across_nodes for pl in plans)  # a column only for a plan over several nodes
    shown = f" (the {len(plans)} fastest shown)" if valid is not None and valid > len(plans) else ""
    what = "layouts, each with each setting searched," if any(pl.settings for pl in plans) else "layouts"
    lines = [f"{valid if valid is not None else len(plans)} valid {what} on {world} devices ({device_memory_gib:.4g} "
             f"GiB each), fastest first{shown}:", "",
             "| rank | layout | batch split | step s | tokens/s/device | compute | exposed comm | bubble | recompute "
             "| GiB/device | states | activations | fits |" + (" across nodes |" if nodes else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if nodes else "")]
    for i, pl in enumerate(plans, 1):
        b = pl.step.breakdown()
        lines.append(f"| {i} | {pl.name} | {pl.split} | {pl.step.step_s:.3f} | {pl.tokens_per_s:,.0f} "
                     f"| {b['compute']:.3f} | {b['exposed_comm']:.3f} | {b['bubble']:.3f} | {b['recompute']:.3f} "
                     f"| {pl.memory_gib:.2f} | {pl.parts_gib['states']:.2f} "
                     f"| {pl.parts_gib['activations'] + pl.parts_gib['checkpoints']:.2f} "
                     f"| {'yes' if pl.fits else 'NO'} |" + (f" {' '.join(pl.across_nodes) or '-'} |" if nodes else ""))
    return "\n".join(lines) + "\n"


def sweep_overrides(plans: list[Plan], base_overrides: list[str]) -> list[str]:
    """The command line a sweep written from `plans` runs with: `base_overrides` less those whose
    keys a plan sets (its layout, batch split, ranks per node, searched settings), which on the
    command line would win over every candidate's own."""
    keys = {override_key(o) for pl in plans for o in (*pl.overrides, *pl.settings)} | {"cluster.nproc_per_node"}
    return [o for o in base_overrides if override_key(o) not in keys]


def write_sweep(plans: list[Plan], name: str, top: int, base_overrides: list[str], folder: Path | None = None) -> Path:
    """The top-k layouts that fit, as a sweep preset: `python launch.py -m +sweep=NAME`. Each
    layout (with the settings of the other axes searched, as the plan predicted them) is one value
    of a `+plan_layout` choice, so the sweep runs exactly those candidates. Written to
    the user's sweeps/ (config.user_sweeps), never into the package."""
    folder = folder or user_sweeps()
    chosen = [pl for pl in plans if pl.fits][:top]
    layouts = {f"{name}_{i}": pl.overrides for i, pl in enumerate(chosen)}
    preset = {
        "hydra": {"sweeper": {"params": {"+plan_layout": ",".join(layouts)}}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.yaml"
    header = (f"# Written by python -m titan_exp.perf.plan {' '.join(base_overrides)}\n"
              f"# The {len(chosen)} fastest predicted layouts that fit; run: python launch.py -m +sweep={name} "
              f"{' '.join(sweep_overrides(chosen, base_overrides))}\n")
    out.write_text(header + yaml.safe_dump(preset, sort_keys=False))
    layout_dir = folder / "plan_layout"
    layout_dir.mkdir(exist_ok=True)
    for (key, overrides), pl in zip(layouts.items(), chosen):
        node: dict = {}
        for o in overrides:
            path, value = o.split("=")
            group, attr = path.split(".")
            node.setdefault(group, {})[attr] = int(value)
        node.setdefault("cluster", {})["nproc_per_node"] = world_of(pl.degrees) // pl.nodes  # ranks per node
        for section, values in settings_config(pl.job, pl.settings).items():
            node.setdefault(section, {}).update(values)
        (layout_dir / f"{key}.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return out


def device_memory_gib(world: int, cuda: bool) -> float:
    """Memory per device when not given: this GPU's, or this machine's RAM shared by the ranks."""
    import os

    import torch

    if cuda and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world
