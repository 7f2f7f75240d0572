"""`python -m titan_exp.perf.plan`: every valid layout of a model on N devices, with predicted
step time, tokens/s per device and memory per device, ranked (titan_exp.perf.planner).

    python -m titan_exp.perf.plan model=llama3_100m --world 4 training.global_batch_size=16
    python -m titan_exp.perf.plan model=llama3_100m --world 4 --write-sweep plan_100m_4
    python -m titan_exp.perf.plan model=llama3_8b --device h100 --world 512 --gpus-per-node 8
    python -m titan_exp.perf.plan model=llama3_8b --hardware my_cluster.yaml --world 512

Positional arguments are the Hydra overrides `launch.py` takes (model, batch, AC, ...). Each
layout runs at its fastest predicted split of the global batch (local batch, accumulation, PP
microbatch; `--keep-split` keeps the configured local batch). `autotune.search` names the other
axes to plan besides the layout, as autotune searches them (titan_exp.perf.search): with
`'autotune.search=[layout,activation_checkpoint,compile,precision]'` each layout is planned at
every AC mode, compile on and off, and each precision a GPU (or a CPU) trains fastest with; the
compile axis is calibrated too. On this machine the plan first measures what the machine profile
lacks for the model (its block at every TP degree, the collectives at the world size), through the
configured executor, unless autotune.calibrate=false:
then the first line says which parts are FLOPs estimates and how far off those were when last
checked. From a spec sheet (`--device`) nothing is measured. `--hardware FILE` describes your
cluster in a small YAML file (titan_exp.perf.devices.HARDWARE_KEYS): its GPU, by spec name or by its
numbers, GPUs per node, NVLink and network bandwidth, latencies; the plan's first line says which
values came from the file. The override `cluster.hardware=FILE` (or a cluster preset that sets it)
names the same file: the flag is its shortcut, and giving both is refused. On GPUs a line after
the table says when the fastest layout that fits leaves less memory to spare than the memory
model's worst error on published runs (planner.margin_line); the last line is the job as
configured (planner.configured_line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from pathlib import Path

from titan_exp.config import AutotuneAxis, Executor, compose_job
from titan_exp.config.autotune import check as search_check
from titan_exp.perf.calibrate import cover
from titan_exp.perf.fit import estimates_line
from titan_exp.perf.planner import (batch_line, configured_line, device_memory_gib, margin_line, plan, profile_line,
                                    sweep_overrides, to_markdown, write_sweep)
from titan_exp.perf.profile import profiles_dir, this_machine


def main(argv: list[str] | None = None) -> int:
    import torch

    from titan_exp.perf.devices import SPECS

    parser = argparse.ArgumentParser(prog="python -m titan_exp.perf.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py (model=..., training....)")
    parser.add_argument("--world", type=int, required=True, help="devices (ranks) to plan for")
    parser.add_argument("--device-memory-gib", type=float, default=None,
                        help="memory per device; default: this GPU's, or this machine's RAM / world")
    parser.add_argument("--cuda", action="store_true", default=torch.cuda.is_available(),
                        help="plan for GPUs (default: whether this machine has one)")
    parser.add_argument("--profile-dir", default=None, help="where machine profiles live (default: <cache>/perf)")
    parser.add_argument("--device", default=None, help="plan for GPUs you do not have here, from their spec sheet "
                        f"(titan_exp/perf/devices.py: {', '.join(SPECS)}); a profile calibrated on that GPU "
                        "replaces the spec one")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="with --device: GPUs per node (default 8); "
                        "mesh dims whose groups span nodes pay the network's costs")
    parser.add_argument("--hardware", metavar="FILE", default=None, help="your cluster in a YAML file: device (a spec "
                        "name or its numbers), gpus_per_node, nvlink_gb_s, network_gb_s (or NCCL's measured "
                        "nvlink_bus_gb_s, network_bus_gb_s), latency_nvlink_us, latency_network_us, "
                        "power_limit_w, host_cpu; instead of --device and --gpus-per-node (a shortcut for the "
                        "override cluster.hardware=FILE)")
    parser.add_argument("--keep-split", action="store_true",
                        help="every layout at the configured local batch, not at its fastest split of the global batch")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--write-sweep", metavar="NAME", help="write the top layouts as ./sweeps/NAME.yaml "
                        "(or $TITAN_EXP_SWEEPS/NAME.yaml), for -m +sweep=NAME")
    args = parser.parse_intermixed_args(argv)  # overrides and flags in any order
    job = compose_job(args.overrides)
    folder = Path(args.profile_dir) if args.profile_dir else None
    first = []
    if job.cluster.hardware is not None:  # the same file, named by the job's config
        if args.hardware:
            parser.error(f"--hardware {args.hardware} and cluster.hardware={job.cluster.hardware} both name the "
                         "hardware file; keep one")
        args.hardware = job.cluster.hardware
    if args.hardware and (args.device or args.gpus_per_node):
        parser.error(f"{'cluster.hardware' if job.cluster.hardware else '--hardware'} describes the device and GPUs "
                     "per node: leave out --device and --gpus-per-node")
    if args.gpus_per_node and not args.device:
        parser.error("--gpus-per-node describes the cluster of --device; without it the plan is for this machine")
    refused = search_check(job, cuda=bool(args.device or args.hardware) or args.cuda)  # the axes the plan searches
    if refused:
        parser.error("; ".join(refused))
    if args.device or args.hardware:
        from titan_exp.perf.devices import load_hardware, profile_for, spec_for, spec_profile
        from titan_exp.perf.hardware import read

        try:  # cluster.hardware's errors name it
            hardware = read(job) if job.cluster.hardware else load_hardware(args.hardware) if args.hardware else None
            spec = hardware.spec if hardware else spec_for(args.device)
        except ValueError as exc:
            parser.error(str(exc))
        gpus_per_node = hardware.gpus_per_node if hardware else (args.gpus_per_node or 8)
        if args.world % gpus_per_node and args.world > gpus_per_node:
            parser.error(f"--world {args.world} is not a whole number of nodes of {gpus_per_node} GPUs")
        per_node = min(gpus_per_node, args.world)
        job = dataclasses.replace(job, cluster=dataclasses.replace(  # a cluster of them, not this machine
            job.cluster, executor=Executor.slurm, nnodes=args.world // per_node, nproc_per_node=per_node,
            gpus_per_node=per_node))
        args.cuda, memory = True, args.device_memory_gib or spec.memory_gib
        if hardware:  # the file's cluster as described (a profile calibrated on this machine is not of it)
            first.append(hardware.line())
            profile = spec_profile(spec, args.world, per_node, hardware.efficiency)
        else:
            profile = profile_for(args.device, args.world, per_node, folder)
    else:
        memory = args.device_memory_gib or device_memory_gib(args.world, args.cuda)
        nodes = job.cluster.nodes_for(args.world)
        profile = this_machine(args.world, cuda=args.cuda, folder=folder, nodes=nodes)
        run_dir = (folder or profiles_dir()) / "runs" / time.strftime("%Y%m%d-%H%M%S")
        compiled = job.compile.enable or AutotuneAxis.compile in job.autotune.search
        coverage = cover(job, args.world, profile, compile=compiled, folder=folder, run_dir=run_dir,
                         say=functools.partial(print, flush=True))
        profile = coverage.profile
        if coverage.lacks:
            first.append(estimates_line(coverage.lacks, profile, folder))
        elif coverage.seconds:
            first.append(f"calibrated first ({'; '.join(coverage.lacked)}) in {coverage.seconds:.0f} s "
                         f"(run dir {run_dir})")
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
