"""`python -m titan_exp.perf.plan`: every valid layout of a model on N devices, with predicted
step time, tokens/s per device and memory per device, ranked (titan_exp.perf.search.planner).

    python -m titan_exp.perf.plan model=llama3_100m --world 4 training.global_batch_size=16
    python -m titan_exp.perf.plan model=llama3_100m --world 4 --write-sweep plan_100m_4
    python -m titan_exp.perf.plan model=llama3_8b --device h100 --world 512 --gpus-per-node 8
    python -m titan_exp.perf.plan model=llama3_8b --hardware my_cluster.yaml --world 512

Positional arguments are the Hydra overrides `launch.py` takes (model, batch, AC, ...). Each
layout runs at its fastest predicted split of the global batch (local batch, accumulation, PP
microbatch; `--keep-split` keeps the configured local batch). `autotune.search` names the other
axes to plan besides the layout, as autotune searches them (titan_exp.perf.search.axes): with
`'autotune.search=[layout,activation_checkpoint,compile,precision]'` each layout is planned at
every AC mode, compile on and off, and each precision a GPU (or a CPU) trains fastest with; the
compile axis is calibrated too. On this machine the plan first measures what the machine profile
lacks for the model (its block at every TP degree, the collectives at the world size), through the
configured executor, unless autotune.calibrate=false: then the header's rates line says which
parts are FLOPs estimates, and its accuracy line how far off those were when last checked. The
header says what is planned (model, precision, seq, global batch, AC, compile, devices); rows
within the quoted error of the fastest are marked as a tie, and the top rows come with the command
that launches them. From a spec sheet (`--device`) nothing is measured. `--hardware FILE` describes your
cluster in a small YAML file (titan_exp.perf.rates.hardware.HARDWARE_KEYS): its GPU, by spec name or by its
numbers, GPUs per node, NVLink and network bandwidth, latencies; the plan's first line says which
values came from the file. The override `cluster.hardware=FILE` (or a cluster preset that sets it)
names the same file: the flag is its shortcut, and giving both is refused. On GPUs a line after
the table says when the fastest layout that fits leaves less memory to spare than the memory
model's worst error on published runs (margin_line); the last line is the job as
configured (configured_line). `--tokens N` plans a run instead: each GPU count's fastest layout, days,
GPU-hours and cost (titan_exp.perf.search.run; plan_run dispatches to it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
import typing
from pathlib import Path

from titan_exp.config import AutotuneAxis, Executor, JobConfig, ParallelismConfig, compose_job, layout_label, world_of
from titan_exp.config.autotune import check as search_check
from titan_exp.perf.calibration.run import cover
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.accuracy import accuracy_kind, last_accuracy, last_check, published
from titan_exp.perf.rates.profile import MachineProfile, profiles_dir, this_machine
from titan_exp.perf.search import run
from titan_exp.perf.search.axes import override_key
from titan_exp.perf.search.layouts import (
    batch_line,
    configured_layout,
    degrees_of,
    global_batch_of,
    split_label,
    with_layout,
)
from titan_exp.perf.search.planner import Plan, device_memory_gib, plan
from titan_exp.perf.search.sweep import entry_point, launch_overrides, sweep_overrides, write_sweep
from titan_exp.validation import resolve, validate


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
    worst error on held-out published GPU runs (rates.accuracy.published's memory), a line that says so and
    names the fastest plan that leaves that margin."""
    best = next((pl for pl in plans if pl.fits), None)
    rows, _, worst = published()["memory"]
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


def rates_line(profile: MachineProfile, lacks: list[str]) -> str:
    """Where the plan's times come from: a spec sheet, a measured profile, or default costs."""
    if lacks:
        return f"rates: FLOPs estimates, nothing measured (autotune.calibrate=false), for {'; '.join(lacks)}"
    if profile.source == "spec":
        return f"rates: {profile.notes[0] if profile.notes else profile.name} (nothing measured)"
    if profile.source == "defaults":
        return (f"rates: default costs, no profile for this machine at world {profile.key['world']} "
                f"(python -m titan_exp.perf.calibrate --world {profile.key['world']} measures one)")
    c = profile.corrections
    fitted = f", refit to {c.measurements} measured runs" if c.measurements else ""
    return f"rates: the measured machine profile {profile.name} ({profile.created}{fitted})"


def quoted_error(profile: MachineProfile, lacks: list[str], folder: Path | None) -> tuple[float | None, str]:
    """The median |tokens/s error| such plans had when last checked, and where: on published GPU
    runs for a spec sheet (its device's own rows where it has any), else on this machine's runs."""
    if profile.source == "spec":
        seen, device = published(), profile.key.get("device")
        runs, _, size = seen["by_device"].get(device, (0, 0.0, 0.0))
        overall = f"{seen['rows']} published GPU runs, {seen['date']}"
        if runs:
            return size, f"on {runs} published {device} runs ({seen['median_abs_error']:.0%} on all {seen['rows']})"
        return seen["median_abs_error"], f"on {overall}"
    if profile.source == "defaults" and not lacks:
        seen = last_accuracy(accuracy_kind(profile))
        if not seen:
            return None, "never checked against real runs on this machine"
        return seen["median_abs_error"], f"on {seen['runs']} real runs here, {seen['when']}"
    check = last_check(profile, estimated=bool(lacks), folder=folder)
    return check.median_abs_error, f"when last checked: {check.where}, {check.when}"


def accuracy_line(error: float | None, where: str) -> str:
    """The plan's caveat, in one line: how far off such tokens/s were, and what counts as a tie."""
    if error is None:
        return f"accuracy: unknown ({where}); rows are not marked as ties"
    return f"accuracy: tokens/s off by {error:.0%} at the median {where}; a tie: within {error:.0%} of the fastest"


def planned_line(job: JobConfig) -> str:
    """What the plan plans: the model and the training settings every layout runs with."""
    m, on = job.model, {True: "on", False: "off"}
    params = f"{count(m.num_params)} parameters" + (f", {count(m.active_params)} active" if m.is_moe else "")
    return (f"plan: {m.flavor} ({params}), {job.precision.name}, seq {job.training.seq_len:,}, "
            f"AC {job.activation_checkpoint.mode.value}, compile {on[job.compile.enable]}")


def count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def devices_line(job: JobConfig, world: int, memory: float, elsewhere: str | None) -> str:
    """The machine the plan is for: `elsewhere`'s GPUs (a spec name) in nodes, or this machine's ranks."""
    if elsewhere is None:
        return f"devices: {world} ranks on this machine, {memory:.4g} GiB each"
    nodes = job.cluster.nnodes
    return (f"devices: {world} x {elsewhere}, {memory:.4g} GiB each, {nodes} node{'s' if nodes > 1 else ''} "
            f"of {job.cluster.nproc_per_node}")


def tie_line(plans: list[Plan], tied: int, error: float | None, device_memory_gib: float) -> str | None:
    """Which of the fastest rows are within the quoted error of the first (`tied` of them: a tie,
    their order is not a prediction), and which of them leaves the most memory to spare."""
    fits = [pl for pl in plans if pl.fits]
    if error is None or len(fits) < 2:
        return None
    if tied == 1:
        return (f"no tie: rank 2 is predicted {fits[1].tokens_per_s / fits[0].tokens_per_s - 1:+.1%}, "
                f"outside the {error:.0%} quoted error")
    roomy = roomiest(plans, tied)
    pl = plans[roomy]
    return (f"ties: ranks 1-{tied} are within the {error:.0%} quoted error of the fastest; of them rank {roomy + 1}, "
            f"{pl.name} ({pl.split}), leaves the most memory: {device_memory_gib - pl.memory_gib:.1f} GiB free")


def roomiest(plans: list[Plan], tied: int) -> int:
    """The index of the tied row (one of the first `tied`, which all fit) that needs the least memory."""
    return min(range(tied), key=lambda i: plans[i].memory_gib)


def tied_count(plans: list[Plan], error: float | None) -> int:
    """How many of the first rows (all fit) are within `error` of the fastest's tokens/s."""
    if error is None or not plans or not plans[0].fits:
        return 0
    floor = plans[0].tokens_per_s * (1 - error)
    return next((i for i, pl in enumerate(plans) if not pl.fits or pl.tokens_per_s < floor), len(plans))


def to_markdown(plans: list[Plan], world: int, device_memory_gib: float, valid: int | None = None,
                tied: int = 0) -> str:
    """The plans as a table, of `valid` layouts (all of them: `plans`, unless only the top are
    shown), the first `tied` marked as a tie; times are seconds per step, by part
    (perf.model.step.BREAKDOWN)."""
    nodes = any(pl.across_nodes for pl in plans)  # a column only for a plan over several nodes
    shown = f" (the {len(plans)} fastest shown)" if valid is not None and valid > len(plans) else ""
    what = "layouts, each with each setting searched," if any(pl.settings for pl in plans) else "layouts"
    lines = [f"{valid if valid is not None else len(plans)} valid {what} on {world} devices ({device_memory_gib:.4g} "
             f"GiB each), fastest first{shown}:", "",
             "| rank | tie | layout | batch split | step s | tokens/s/device | compute | exposed comm | bubble "
             "| recompute | GiB/device | states | activations | fits |" + (" across nodes |" if nodes else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if nodes else "")]
    for i, pl in enumerate(plans, 1):
        b = pl.step.breakdown()
        lines.append(f"| {i} | {'tie' if i <= tied else ''} | {pl.name} | {pl.split} | {pl.step.step_s:.3f} "
                     f"| {pl.tokens_per_s:,.0f} "
                     f"| {b['compute']:.3f} | {b['exposed_comm']:.3f} | {b['bubble']:.3f} | {b['recompute']:.3f} "
                     f"| {pl.memory_gib:.2f} | {pl.parts_gib['states']:.2f} "
                     f"| {pl.parts_gib['activations'] + pl.parts_gib['checkpoints']:.2f} "
                     f"| {'yes' if pl.fits else 'NO'} |" + (f" {' '.join(pl.across_nodes) or '-'} |" if nodes else ""))
    return "\n".join(lines) + "\n"


def launch_lines(plans: list[Plan], tied: int, base_overrides: list[str], job: JobConfig,
                 elsewhere: str | None) -> list[str]:
    """The commands that launch the top three rows that fit (and the roomiest tied row): the plan's
    overrides, the row's, and its world's shape; on GPUs elsewhere through SLURM (cluster=slurm,
    unless a cluster preset is named), saying what a site may need added."""
    fits = [pl for pl in plans if pl.fits]
    rows = list(range(min(3, len(fits))))
    if tied > 3:
        rows.append(roomiest(plans, tied))
    if not rows:
        return []
    entry, cluster = entry_point(), cluster_preset(base_overrides, elsewhere)
    lines = [f"to launch (on {fits[0].nodes} node{'s' if fits[0].nodes > 1 else ''} of "
             f"{world_of(fits[0].degrees) // fits[0].nodes}{' GPUs through SLURM' if cluster else ''}):"]
    for i in sorted(set(rows)):
        overrides = [*cluster, *changed(launch_overrides(fits[i], base_overrides), job)]
        lines.append(f"  rank {i + 1}: {entry} {' '.join(overrides)}")
    if cluster:
        lines.append("  (cluster=slurm takes your site's defaults: add cluster.partition=... or cluster.account=... "
                     "where it needs them, or name your cluster preset)")
    return lines


def cluster_preset(base_overrides: list[str], elsewhere: str | None) -> list[str]:
    """`cluster=slurm` for GPUs planned elsewhere unless the plan's overrides name a cluster preset."""
    named = any(override_key(o) == "cluster" for o in base_overrides)
    return ["cluster=slurm"] if elsewhere is not None and not named else []


def changed(overrides: list[str], job: JobConfig) -> list[str]:
    """`overrides` less the layout and batch fields that already have that value in `job`, so a
    launch line says what differs from the job as composed."""
    from omegaconf import OmegaConf

    composed = OmegaConf.structured(job)
    return [o for o in overrides if not (o.startswith(("parallelism.", "training.local_batch_size", "cluster.nnodes"))
                                         and str(OmegaConf.select(composed, override_key(o))) == o.split("=", 1)[1])]


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are one line naming the flag and the fix (the usage is under --help), exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def parser() -> argparse.ArgumentParser:
    import torch

    from titan_exp.perf.rates.devices import SPECS

    out = OneLineParser(prog="python -m titan_exp.perf.plan", description=__doc__.split("\n\n")[0])
    out.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py (model=..., training....)")
    out.add_argument("--world", type=int, default=None, help="devices (ranks) to plan one step for")
    out.add_argument("--device-memory-gib", type=float, default=None,
                     help="memory per device; default: this GPU's, or this machine's RAM / world")
    out.add_argument("--cuda", action="store_true", default=torch.cuda.is_available(),
                     help="plan for GPUs (default: whether this machine has one)")
    out.add_argument("--profile-dir", default=None, help="where machine profiles live (default: <cache>/perf)")
    out.add_argument("--device", default=None, type=str.lower,
                     help="plan for GPUs you do not have here, from their spec sheet (any case: "
                     f"{', '.join(SPECS)}); a profile calibrated on that GPU replaces the spec one")
    out.add_argument("--gpus-per-node", type=int, default=None, help="with --device: GPUs per node (default 8); "
                     "mesh dims whose groups span nodes pay the network's costs")
    out.add_argument("--hardware", metavar="FILE", default=None, help="your cluster in a YAML file: device (a spec "
                     "name or its numbers), gpus_per_node, nvlink_gb_s, network_gb_s (or NCCL's measured "
                     "nvlink_bus_gb_s, network_bus_gb_s), latency_nvlink_us, latency_network_us, "
                     "power_limit_w, host_cpu; instead of --device and --gpus-per-node (a shortcut for the "
                     "override cluster.hardware=FILE)")
    out.add_argument("--keep-split", action="store_true",
                     help="every layout at the configured local batch, not at its fastest split of the global batch")
    out.add_argument("--top", type=int, default=10)
    out.add_argument("--write-sweep", metavar="NAME", help="write the top layouts as ./sweeps/NAME.yaml "
                     "(or $TITAN_EXP_SWEEPS/NAME.yaml), and print the command that runs them")
    run.add_flags(out)  # --tokens: a run at every GPU count (titan_exp.perf.search.run)
    return out


# The training settings a plan will not take from the schema's defaults (the debug model's) for a
# model of a billion parameters or more: its preset or the command line must state them.
STATED = ("precision", "training.seq_len")


def guessed(job: JobConfig, overrides: list[str]) -> list[str]:
    """STATED's fields that neither the model preset nor the command line set, for a model of 1B
    parameters or more (a smaller one plans at the defaults, as it trains)."""
    if job.model.num_params < 1e9:
        return []
    default, named = compose_job([]), [override_key(o) for o in overrides]
    now = {"precision": (job.precision.name, default.precision.name),
           "training.seq_len": (job.training.seq_len, default.training.seq_len)}
    return [f"{key}={mine}" for key, (mine, unset) in now.items()
            if mine == unset and not any(n == key or n.startswith(key + ".") for n in named)]


def check_flags(cli: argparse.ArgumentParser, args: argparse.Namespace, job: JobConfig) -> None:
    """Refuse flags that contradict each other or the job, and a plan of settings nobody stated
    (one line, exit 2)."""
    unstated = guessed(job, args.overrides)
    if unstated:
        cli.error(f"model={job.model.flavor} does not say what it trains with, and the plan does not guess: "
                  f"{' and '.join(unstated)} are the debug model's; state them (e.g. precision=bf16 "
                  "training.seq_len=8192), as they are if that is what you train")
    if job.cluster.hardware is not None:  # the same file, named by the job's config
        if args.hardware:
            cli.error(f"--hardware {args.hardware} and cluster.hardware={job.cluster.hardware} both name the "
                      "hardware file; keep one")
        args.hardware = job.cluster.hardware
    if args.hardware and (args.device or args.gpus_per_node):
        cli.error(f"{'cluster.hardware' if job.cluster.hardware else '--hardware'} describes the device and GPUs "
                  "per node: leave out --device and --gpus-per-node")
    if args.gpus_per_node and not args.device:
        cli.error("--gpus-per-node describes the cluster of --device; without it the plan is for this machine")
    refused = search_check(job, cuda=bool(args.device or args.hardware) or args.cuda)  # the axes the plan searches
    if refused:
        cli.error("; ".join(refused))


def cluster_of(cli: argparse.ArgumentParser, args: argparse.Namespace, job: JobConfig) -> tuple[typing.Any, ...]:
    """--device or --hardware: the hardware file (None for --device), the GPU's spec sheet, GPUs per node."""
    from titan_exp.perf.rates.devices import spec_for
    from titan_exp.perf.rates.hardware import load_hardware, read

    try:  # cluster.hardware's errors name it
        hardware = read(job) if job.cluster.hardware else load_hardware(args.hardware) if args.hardware else None
        spec = hardware.spec if hardware else spec_for(args.device)
    except ValueError as exc:
        cli.error(str(exc))
    return hardware, spec, hardware.gpus_per_node if hardware else (args.gpus_per_node or 8)


def on_gpus_elsewhere(cli: argparse.ArgumentParser, args: argparse.Namespace, job: JobConfig,
                      folder: Path | None) -> tuple[JobConfig, MachineProfile, float, list[str], str]:
    """--device or --hardware: the job on a cluster of those GPUs, their profile (calibrated on that
    GPU if one was, else the spec sheet's), their memory, the hardware file's line, and the GPU's name."""
    from titan_exp.perf.rates.devices import profile_for, spec_profile

    hardware, spec, gpus_per_node = cluster_of(cli, args, job)
    if args.world % gpus_per_node and args.world > gpus_per_node:
        cli.error(f"--world {args.world} is not a whole number of nodes of {gpus_per_node} GPUs")
    per_node = min(gpus_per_node, args.world)
    job = dataclasses.replace(job, cluster=dataclasses.replace(  # a cluster of them, not this machine
        job.cluster, executor=Executor.slurm, nnodes=args.world // per_node, nproc_per_node=per_node,
        gpus_per_node=per_node))
    memory = args.device_memory_gib or spec.memory_gib
    if hardware:  # the file's cluster as described (a profile calibrated on this machine is not of it)
        profile = spec_profile(spec, args.world, per_node, hardware.efficiency)
        return job, profile, memory, [hardware.line()], spec.name
    return job, profile_for(args.device, args.world, per_node, folder), memory, [], spec.name


def on_this_machine(args: argparse.Namespace, job: JobConfig,
                    folder: Path | None) -> tuple[MachineProfile, float, list[str], list[str]]:
    """This machine's profile, with what it lacks for the job calibrated first (unless
    autotune.calibrate=false), its memory per device, what it still lacks (FLOPs estimates), and
    what the plan says of that first."""
    memory = args.device_memory_gib or device_memory_gib(args.world, args.cuda)
    profile = this_machine(args.world, cuda=args.cuda, folder=folder, nodes=job.cluster.nodes_for(args.world))
    run_dir = (folder or profiles_dir()) / "runs" / time.strftime("%Y%m%d-%H%M%S")
    compiled = job.compile.enable or AutotuneAxis.compile in job.autotune.search
    coverage = cover(job, args.world, profile, compile=compiled, folder=folder, run_dir=run_dir,
                     say=functools.partial(print, flush=True))
    first = []
    if coverage.seconds and not coverage.lacks:
        first.append(f"calibrated first ({'; '.join(coverage.lacked)}) in {coverage.seconds:.0f} s "
                     f"(run dir {run_dir})")
    return coverage.profile, memory, list(coverage.lacks), first


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_intermixed_args(argv)  # overrides and flags in any order
    if args.world is None and args.tokens is None:
        cli.error("the following arguments are required: --world (or --tokens N, to plan a run)")
    job = composed = compose_job(args.overrides)
    folder = Path(args.profile_dir) if args.profile_dir else None
    check_flags(cli, args, job)
    if refused := run.refusal(args, job):
        cli.error(refused)
    if args.tokens is not None:
        return plan_run(cli, args, job, composed, folder)
    lacks, elsewhere = [], None
    if args.device or args.hardware:
        job, profile, memory, first, elsewhere = on_gpus_elsewhere(cli, args, job, folder)
        args.cuda = True
    else:
        profile, memory, lacks, first = on_this_machine(args, job, folder)
    plans = plan(job, args.world, device_memory_gib=memory, cuda=args.cuda, profile=profile,
                 any_split=not args.keep_split, axes=job.autotune.search)
    error, where = quoted_error(profile, lacks, folder)
    tied = tied_count(plans, error)
    for line in [*first, planned_line(job), batch_line(job, args.world),
                 devices_line(job, args.world, memory, elsewhere), rates_line(profile, lacks),
                 accuracy_line(error, where)]:
        print(line)
    for note in sorted({n for pl in plans for n in pl.step.notes}):
        print(f"  note: {note}")
    print(to_markdown(plans[: args.top] if args.top else plans, args.world, memory, valid=len(plans), tied=tied))
    tight = margin_line(plans, memory) if args.cuda else None
    mine = configured_line(job, args.world, plans, profile, device_memory_gib=memory, cuda=args.cuda)
    launch = launch_lines(plans, tied, args.overrides, composed, elsewhere)
    for line in (tie_line(plans, tied, error, memory), tight, *launch, mine):
        if line:
            print(line)
    if args.write_sweep:
        print(sweep_line(plans, args, elsewhere))
    return 0


def plan_run(cli: argparse.ArgumentParser, args: argparse.Namespace, job: JobConfig, composed: JobConfig,
             folder: Path | None) -> int:
    """--tokens: the run at each GPU count the cluster offers (titan_exp.perf.search.run) under the
    plan's header lines, then the launch line (or the written sweep) of the count picked."""
    try:
        question = run.question(args, job, cluster_of(cli, args, job)[2])
    except ValueError as exc:
        cli.error(str(exc))
    setups = {}

    def at(world: int) -> tuple[JobConfig, MachineProfile, float]:
        args.world = world
        setups[world] = on_gpus_elsewhere(cli, args, job, folder)
        return setups[world][:3]

    rows = run.plan_run(question.counts, at, question.batches, job.autotune.search)
    _, profile, memory, first, name = setups[question.counts[0]]
    error, where = quoted_error(profile, [], folder)
    for line in [*first, planned_line(job), *run.report(question, rows, job, f"{name} ({memory:.4g} GiB)",
                                                        rates_line(profile, []), (error, where))]:
        print(line)
    try:
        row, why = run.picked(rows, question)
    except ValueError as exc:
        cli.error(str(exc))
    if row is not None:
        print(f"picked: {why}")
        args.overrides = run.with_steps(args.overrides, question, row, job)
        for line in launch_lines([row.plan], 0, args.overrides, composed, name):
            print(line)
        if args.write_sweep:
            print(sweep_line([row.plan], args, name))
    return 0


def sweep_line(plans: list[Plan], args: argparse.Namespace, elsewhere: str | None) -> str:
    """Writes the top layouts that fit as a named sweep and says the command that runs it, as printed."""
    chosen = [pl for pl in plans if pl.fits][: args.top]
    command = " ".join([entry_point(), "-m", f"+sweep={args.write_sweep}", *cluster_preset(args.overrides, elsewhere),
                        *sweep_overrides(chosen, args.overrides)])
    out = write_sweep(plans, args.write_sweep, args.top, args.overrides, command=command)
    return f"wrote {out}; run it (from this folder): {command}"


if __name__ == "__main__":
    raise SystemExit(main())
