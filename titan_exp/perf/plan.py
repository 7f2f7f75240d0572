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
configured executor, unless autotune.calibrate=false:
then the first line says which parts are FLOPs estimates and how far off those were when last
checked. From a spec sheet (`--device`) nothing is measured. `--hardware FILE` describes your
cluster in a small YAML file (titan_exp.perf.rates.hardware.HARDWARE_KEYS): its GPU, by spec name or by its
numbers, GPUs per node, NVLink and network bandwidth, latencies; the plan's first line says which
values came from the file. The override `cluster.hardware=FILE` (or a cluster preset that sets it)
names the same file: the flag is its shortcut, and giving both is refused. On GPUs a line after
the table says when the fastest layout that fits leaves less memory to spare than the memory
model's worst error on published runs (margin_line); the last line is the job as
configured (configured_line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path

from titan_exp.config import AutotuneAxis, Executor, JobConfig, ParallelismConfig, compose_job, layout_label
from titan_exp.config.autotune import check as search_check
from titan_exp.perf.calibration.run import cover
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.accuracy import accuracy_kind, estimates_line, last_accuracy, published
from titan_exp.perf.rates.profile import MachineProfile, profiles_dir, this_machine
from titan_exp.perf.search.layouts import (
    batch_line,
    configured_layout,
    degrees_of,
    global_batch_of,
    split_label,
    with_layout,
)
from titan_exp.perf.search.planner import Plan, device_memory_gib, plan
from titan_exp.perf.search.sweep import sweep_overrides, write_sweep
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


def profile_line(profile: MachineProfile) -> str:
    """Which profile the times come from, or that they are the defaults and how wrong those were."""
    if profile.source == "spec":
        seen = published()
        device = profile.key.get("device")
        runs, signed, size = seen["by_device"].get(device, (0, 0.0, 0.0))
        median_run = ("as measured" if abs(signed) < 0.005
                      else f"{abs(signed):.0%} too {'slow' if signed < 0 else 'fast'}")
        own = (f"; on {device}'s sheet alone ({runs} run{'s' if runs > 1 else ''}) {size:.0%} at the median, the "
               f"median run predicted {median_run}" if runs else "")
        return (f"times PREDICTED FROM A SPEC SHEET ({profile.notes[0] if profile.notes else profile.name}); held out "
                f"against {seen['rows']} published GPU runs ({seen['date']}, python -m benchmarks.published) such "
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
    shown); times are seconds per step, by part (perf.model.step.BREAKDOWN)."""
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


def parser() -> argparse.ArgumentParser:
    import torch

    from titan_exp.perf.rates.devices import SPECS

    out = argparse.ArgumentParser(prog="python -m titan_exp.perf.plan", description=__doc__.split("\n\n")[0])
    out.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py (model=..., training....)")
    out.add_argument("--world", type=int, required=True, help="devices (ranks) to plan for")
    out.add_argument("--device-memory-gib", type=float, default=None,
                     help="memory per device; default: this GPU's, or this machine's RAM / world")
    out.add_argument("--cuda", action="store_true", default=torch.cuda.is_available(),
                     help="plan for GPUs (default: whether this machine has one)")
    out.add_argument("--profile-dir", default=None, help="where machine profiles live (default: <cache>/perf)")
    out.add_argument("--device", default=None, help="plan for GPUs you do not have here, from their spec sheet "
                     f"(titan_exp/perf/rates/devices.py: {', '.join(SPECS)}); a profile calibrated on that GPU "
                     "replaces the spec one")
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
                     "(or $TITAN_EXP_SWEEPS/NAME.yaml), for -m +sweep=NAME")
    return out


def check_flags(cli: argparse.ArgumentParser, args: argparse.Namespace, job: JobConfig) -> None:
    """Refuse flags that contradict each other or the job (argparse's error: usage, exit 2)."""
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


def on_gpus_elsewhere(cli: argparse.ArgumentParser, args: argparse.Namespace, job: JobConfig,
                      folder: Path | None) -> tuple[JobConfig, MachineProfile, float, list[str]]:
    """--device or --hardware: the job on a cluster of those GPUs, their profile (calibrated on that
    GPU if one was, else the spec sheet's), their memory, and the hardware file's line."""
    from titan_exp.perf.rates.devices import profile_for, spec_for, spec_profile
    from titan_exp.perf.rates.hardware import load_hardware, read

    try:  # cluster.hardware's errors name it
        hardware = read(job) if job.cluster.hardware else load_hardware(args.hardware) if args.hardware else None
        spec = hardware.spec if hardware else spec_for(args.device)
    except ValueError as exc:
        cli.error(str(exc))
    gpus_per_node = hardware.gpus_per_node if hardware else (args.gpus_per_node or 8)
    if args.world % gpus_per_node and args.world > gpus_per_node:
        cli.error(f"--world {args.world} is not a whole number of nodes of {gpus_per_node} GPUs")
    per_node = min(gpus_per_node, args.world)
    job = dataclasses.replace(job, cluster=dataclasses.replace(  # a cluster of them, not this machine
        job.cluster, executor=Executor.slurm, nnodes=args.world // per_node, nproc_per_node=per_node,
        gpus_per_node=per_node))
    memory = args.device_memory_gib or spec.memory_gib
    if hardware:  # the file's cluster as described (a profile calibrated on this machine is not of it)
        return job, spec_profile(spec, args.world, per_node, hardware.efficiency), memory, [hardware.line()]
    return job, profile_for(args.device, args.world, per_node, folder), memory, []


def on_this_machine(args: argparse.Namespace, job: JobConfig, folder: Path | None) -> tuple[MachineProfile, float,
                                                                                          list[str]]:
    """This machine's profile, with what it lacks for the job calibrated first (unless
    autotune.calibrate=false), its memory per device, and what the plan says of that first."""
    memory = args.device_memory_gib or device_memory_gib(args.world, args.cuda)
    profile = this_machine(args.world, cuda=args.cuda, folder=folder, nodes=job.cluster.nodes_for(args.world))
    run_dir = (folder or profiles_dir()) / "runs" / time.strftime("%Y%m%d-%H%M%S")
    compiled = job.compile.enable or AutotuneAxis.compile in job.autotune.search
    coverage = cover(job, args.world, profile, compile=compiled, folder=folder, run_dir=run_dir,
                     say=functools.partial(print, flush=True))
    first = []
    if coverage.lacks:
        first.append(estimates_line(coverage.lacks, coverage.profile, folder))
    elif coverage.seconds:
        first.append(f"calibrated first ({'; '.join(coverage.lacked)}) in {coverage.seconds:.0f} s "
                     f"(run dir {run_dir})")
    return coverage.profile, memory, first


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_intermixed_args(argv)  # overrides and flags in any order
    job = compose_job(args.overrides)
    folder = Path(args.profile_dir) if args.profile_dir else None
    check_flags(cli, args, job)
    if args.device or args.hardware:
        job, profile, memory, first = on_gpus_elsewhere(cli, args, job, folder)
        args.cuda = True
    else:
        profile, memory, first = on_this_machine(args, job, folder)
    plans = plan(job, args.world, device_memory_gib=memory, cuda=args.cuda, profile=profile,
                 any_split=not args.keep_split, axes=job.autotune.search)
    for line in [*first, profile_line(profile), batch_line(job, args.world)]:
        print(line)
    for note in sorted({n for pl in plans for n in pl.step.notes}):
        print(f"  note: {note}")
    print(to_markdown(plans[: args.top] if args.top else plans, args.world, memory, valid=len(plans)))
    tight = margin_line(plans, memory) if args.cuda else None
    mine = configured_line(job, args.world, plans, profile, device_memory_gib=memory, cuda=args.cuda)
    for line in (tight, mine):
        if line:
            print(line)
    if args.write_sweep:
        out = write_sweep(plans, args.write_sweep, args.top, args.overrides)
        run = sweep_overrides([pl for pl in plans if pl.fits][: args.top], args.overrides)
        print(f"wrote {out}: python launch.py -m +sweep={args.write_sweep} {' '.join(run)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
