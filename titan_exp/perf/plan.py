"""The layout planner: every valid layout of a model on N devices, with predicted step time,
tokens/s per device and memory per device, ranked; optionally written out as a sweep preset.

    python -m titan_exp.perf.plan model=llama3_8b --world 64 --device-memory-gib 80 --top 8
    python -m titan_exp.perf.plan model=llama3_100m --world 4 --write-sweep plan_100m_4

Positional arguments are the same Hydra overrides `launch.py` takes (model, batch, AC, ...).
"Valid" is decided by titan_exp.validation, the same check the launcher runs, so a planned
layout never fails at launch. Time comes from titan_exp.perf.step with this machine's calibrated
profile (`python -m titan_exp.perf.calibrate --world N`), or round-number defaults, which the output
says, with how far off the defaults were the last time they were checked against real runs.
Memory comes from titan_exp.perf.memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

import yaml

from titan_exp.config import LAYOUT_FIELDS, MESH_DIMS, Executor, JobConfig, layout_label, user_sweeps, world_of
from titan_exp.perf.memory import predict_memory
from titan_exp.perf.profile import MachineProfile, last_accuracy, this_machine
from titan_exp.perf.step import StepPrediction, across_nodes, predict_step
from titan_exp.validation import resolve, validate

__all__ = ["Plan", "plan", "predict_memory", "valid_layouts", "with_layout", "layout_overrides", "write_sweep"]


def degrees_of(job: JobConfig) -> dict[str, int]:
    """The job's layout: its mesh degrees, and ep when expert parallel is on."""
    return job.parallelism.layout


def layout_overrides(job: JobConfig) -> list[str]:
    """The overrides that give another job this job's layout and local batch (for an MoE model,
    its expert parallel degree too, 1 included)."""
    layout = degrees_of(job) | ({"ep": job.parallelism.expert_parallel_degree} if job.model.is_moe else {})
    return [f"parallelism.{LAYOUT_FIELDS[dim]}={d}" for dim, d in layout.items()] + [
        f"training.local_batch_size={job.training.local_batch_size}"]


@dataclass
class Plan:
    degrees: dict[str, int]
    local_batch_size: int
    overrides: list[str]
    memory_gib: float
    parts_gib: dict[str, float]
    step: StepPrediction
    fits: bool = True
    across_nodes: tuple[str, ...] = ()  # mesh dims whose groups span nodes (perf.step.across_nodes)

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens/s per device."""
        return self.step.tokens_per_s_per_device

    @property
    def name(self) -> str:
        return layout_label(self.degrees)


def with_layout(job: JobConfig, degrees: dict[str, int], global_batch: int) -> JobConfig:
    """`job` with these degrees, `global_batch` sequences per step, and the largest local batch
    (at most the configured one) that divides it."""
    degrees = {"ep": 1} | degrees  # a layout without ep has none
    p = dataclasses.replace(job.parallelism, **{LAYOUT_FIELDS[dim]: d for dim, d in degrees.items()})
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    local = min(job.training.local_batch_size, max(1, global_batch // dp))
    while local > 1 and global_batch % (local * dp):
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
    and dp_shard x cp (validation decides which of those can be carved)."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for pp, rep, shard, cp in itertools.product(divisors, repeat=4):
        rest = pp * rep * shard * cp
        if world % rest == 0:
            degrees = dict(zip(MESH_DIMS, (pp, rep, shard, cp, world // rest)))
            out.append(degrees)
            out += [degrees | {"ep": ep} for ep in range(2, shard * cp + 1)
                    if n_experts % ep == 0 and (shard * cp) % ep == 0]
    return out


def valid_layouts(job: JobConfig, world: int, *, cuda: bool = False) -> list[JobConfig]:
    gb = job.training.global_batch_size
    global_batch = gb if gb > 0 else job.training.local_batch_size * world
    jobs = (with_layout(job, degrees, global_batch) for degrees in factorizations(world, job.model.n_experts))
    return [resolve(j) for j in jobs if not validate(j, cuda=cuda)]


def plan(job: JobConfig, world: int, *, device_memory_gib: float, cuda: bool = False,
         profile: MachineProfile | None = None) -> list[Plan]:
    """Every valid layout, fastest first among those that fit, then those that do not."""
    nodes = job.cluster.nodes_for(world)
    profile = profile or this_machine(world, cuda=cuda, nodes=nodes)
    plans = []
    for candidate in valid_layouts(job, world, cuda=cuda):
        parts = predict_memory(candidate, cuda=cuda)
        plans.append(Plan(degrees_of(candidate), candidate.training.local_batch_size, layout_overrides(candidate),
                          parts["total"], {k: v for k, v in parts.items() if k != "total"},
                          predict_step(candidate, profile, cuda=cuda), fits=parts["total"] <= device_memory_gib,
                          across_nodes=tuple(d for d in MESH_DIMS if d in across_nodes(candidate))))
    return sorted(plans, key=lambda pl: (not pl.fits, -pl.tokens_per_s))


def profile_line(profile: MachineProfile) -> str:
    """Which profile the times come from, or that they are the defaults and how wrong those were."""
    if profile.source == "spec":
        return (f"times PREDICTED FROM A SPEC SHEET ({profile.notes[0] if profile.notes else profile.name}); "
                "calibrate on the GPU to replace it with measured costs")
    if profile.source == "defaults":
        seen = last_accuracy(profile)
        how = (f"the last check against {seen['runs']} real runs ({seen['when']}) found a median error of "
               f"{seen['median_abs_error']:.0%}" if seen else "never checked against real runs on this machine")
        return (f"times from DEFAULT costs (no profile for this machine and world size: run python -m "
                f"titan_exp.perf.calibrate --world {profile.key['world']}); {how}")
    c = profile.corrections
    fitted = f", refit to {c.measurements} measured runs" if c.measurements else ""
    return f"times predicted from the measured machine profile {profile.name} ({profile.created}{fitted})"


def to_markdown(plans: list[Plan], world: int, device_memory_gib: float) -> str:
    """The plans as a table; times are seconds per step, by part (perf.step.BREAKDOWN)."""
    nodes = any(pl.across_nodes for pl in plans)  # a column only for a plan over several nodes
    lines = [f"{len(plans)} valid layouts on {world} devices ({device_memory_gib:g} GiB each), fastest first:", "",
             "| rank | layout | local batch | step s | tokens/s/device | compute | exposed comm | bubble | recompute "
             "| GiB/device | states | activations | fits |" + (" across nodes |" if nodes else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if nodes else "")]
    for i, pl in enumerate(plans, 1):
        b = pl.step.breakdown()
        lines.append(f"| {i} | {pl.name} | {pl.local_batch_size} | {pl.step.step_s:.3f} | {pl.tokens_per_s:,.0f} "
                     f"| {b['compute']:.3f} | {b['exposed_comm']:.3f} | {b['bubble']:.3f} | {b['recompute']:.3f} "
                     f"| {pl.memory_gib:.2f} | {pl.parts_gib['states']:.2f} "
                     f"| {pl.parts_gib['activations'] + pl.parts_gib['checkpoints']:.2f} "
                     f"| {'yes' if pl.fits else 'NO'} |" + (f" {' '.join(pl.across_nodes) or '-'} |" if nodes else ""))
    return "\n".join(lines) + "\n"


def write_sweep(plans: list[Plan], name: str, top: int, base_overrides: list[str], folder: Path | None = None) -> Path:
    """The top-k layouts that fit, as a sweep preset: `python launch.py -m +sweep=NAME`. Each
    layout is one value of a `+layout` choice, so the sweep runs exactly those layouts. Written to
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
              f"{' '.join(base_overrides)}\n")
    out.write_text(header + yaml.safe_dump(preset, sort_keys=False))
    layout_dir = folder / "plan_layout"
    layout_dir.mkdir(exist_ok=True)
    for (key, overrides), pl in zip(layouts.items(), chosen):
        node: dict = {}
        for o in overrides:
            path, value = o.split("=")
            group, field = path.split(".")
            node.setdefault(group, {})[field] = int(value)
        node.setdefault("cluster", {})["nproc_per_node"] = world_of(pl.degrees)
        (layout_dir / f"{key}.yaml").write_text(yaml.safe_dump(node, sort_keys=False))
    return out


def device_memory_gib(world: int, cuda: bool) -> float:
    """Memory per device when not given: this GPU's, or this machine's RAM shared by the ranks."""
    import os

    import torch

    if cuda and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / world


def main(argv: list[str] | None = None) -> int:
    import torch

    from titan_exp.config import compose_job

    parser = argparse.ArgumentParser(prog="python -m titan_exp.perf.plan", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py (model=..., training....)")
    parser.add_argument("--world", type=int, required=True, help="devices (ranks) to plan for")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory per device; default: this GPU's, or this machine's RAM / world")
    parser.add_argument("--cuda", action="store_true", default=torch.cuda.is_available(),
                        help="plan for GPUs (default: whether this machine has one)")
    parser.add_argument("--profile-dir", default=None, help="where machine profiles live (default: <cache>/perf)")
    parser.add_argument("--device", default=None, help="plan for GPUs you do not have here, from their spec sheet "
                        "(titan_exp/perf/devices.py: h100, h100_500w, h200, a100, b200); a profile calibrated on "
                        "that GPU replaces the spec one")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="with --device: GPUs per node; mesh dims "
                        "whose groups span nodes pay the network's costs")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--write-sweep", metavar="NAME", help="write the top layouts as ./sweeps/NAME.yaml "
                        "(or $TITAN_EXP_SWEEPS/NAME.yaml), for -m +sweep=NAME")
    args = parser.parse_args(argv)
    job = compose_job(args.overrides)
    folder = Path(args.profile_dir) if args.profile_dir else None
    if args.device:
        from titan_exp.perf.devices import profile_for, spec_for

        try:
            spec = spec_for(args.device)
        except ValueError as exc:
            parser.error(str(exc))
        if args.world % args.gpus_per_node and args.world > args.gpus_per_node:
            parser.error(f"--world {args.world} is not a whole number of nodes of --gpus-per-node {args.gpus_per_node}")
        per_node = min(args.gpus_per_node, args.world)
        job = dataclasses.replace(job, cluster=dataclasses.replace(  # a cluster of them, not this machine
            job.cluster, executor=Executor.slurm, nnodes=args.world // per_node, nproc_per_node=per_node,
            gpus_per_node=per_node))
        args.cuda, memory = True, args.device_memory_gib or spec.memory_gib
        profile = profile_for(args.device, args.world, per_node, folder)
    else:
        memory = args.device_memory_gib or device_memory_gib(args.world, args.cuda)
        nodes = job.cluster.nodes_for(args.world)
        profile = this_machine(args.world, cuda=args.cuda, folder=folder, nodes=nodes)
    plans = plan(job, args.world, device_memory_gib=memory, cuda=args.cuda, profile=profile)
    print(profile_line(profile))
    for note in sorted({n for pl in plans for n in pl.step.notes}):
        print(f"  note: {note}")
    print(to_markdown(plans[: args.top] if args.top else plans, args.world, memory))
    if args.write_sweep:
        out = write_sweep(plans, args.write_sweep, args.top, args.overrides)
        print(f"wrote {out}: python launch.py -m +sweep={args.write_sweep} {' '.join(args.overrides)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
