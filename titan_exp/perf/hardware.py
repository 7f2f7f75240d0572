"""`cluster.hardware=FILE`: the GPUs a job's ranks run on, described in a hardware file (the YAML
that `python -m titan_exp.perf.plan --hardware` reads, titan_exp.perf.devices.load_hardware). The
file's profile replaces this machine's in every prediction made for the job: autotune's candidates
and its memory limit, the dry run's predicted step, cluster.elastic's re-plan, and the predicted
step the launcher logs before the ranks start.

The job's nodes are its own (cluster.nnodes, and the ranks on each); the file's `gpus_per_node` is
what a node holds, so a job may put fewer ranks on a node, never more. The device memory a
prediction is checked against is autotune.device_memory_gib when set, else the file's GPU's.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from titan_exp.config import Executor, JobConfig, problem
from titan_exp.perf.devices import HARDWARE_KEYS, Hardware, load_hardware, spec_profile
from titan_exp.perf.profile import MachineProfile

FIELD = "cluster.hardware"


def read(job: JobConfig) -> Hardware | None:
    """The job's hardware file, read (None without one), or a ValueError naming cluster.hardware,
    its value, what is wrong and the fix."""
    value = job.cluster.hardware
    if value is None:
        return None
    if not Path(value).expanduser().is_file():
        raise ValueError(problem(FIELD, value, "no such file; give the path of a hardware YAML (keys: "
                                 + ", ".join(HARDWARE_KEYS) + "), or null to predict from this machine's profile"))
    try:
        return load_hardware(Path(value).expanduser())
    except ValueError as exc:
        raise ValueError(problem(FIELD, value, str(exc).removeprefix("--hardware "))) from None


def checked(job: JobConfig) -> tuple[Hardware | None, list[str]]:
    """The job's hardware file, read once (None without one), and why the job cannot use it: the
    file itself, ranks on CPUs (the file describes GPUs; a dry run, which only predicts for them,
    may run anywhere), or more ranks on a node than the file's nodes hold."""
    from titan_exp.validation import ranks_have_gpus

    try:
        hardware = read(job)
    except ValueError as exc:
        return None, [str(exc)]
    if hardware is None:
        return None, []
    value, c = job.cluster.hardware, job.cluster
    e = []
    if not c.dry_run and not ranks_have_gpus(job):
        where = "cluster.gpus_per_node = 0" if c.executor == Executor.slurm else "this machine has no GPU"
        e.append(problem(FIELD, value, f"the file describes GPUs, and this job's ranks run on CPUs ({where}); "
                         "run it where the file's GPUs are, or dry-run it (cluster.dry_run=true), or remove "
                         "cluster.hardware"))
    held = hardware.from_file.get("gpus_per_node")
    per_node = math.ceil(job.world_size / c.nnodes)
    if held is not None and per_node > held:
        nodes = math.ceil(job.world_size / held)
        e.append(problem(FIELD, value, f"its nodes hold gpus_per_node {held} GPUs, and the job puts {per_node} ranks "
                         f"on each of its {c.nnodes} node(s), one per GPU; set cluster.nnodes={nodes} "
                         f"cluster.nproc_per_node={held}" + ("" if job.world_size % held == 0 else
                                                              f" (and a world size divisible by {held})")))
    return hardware, e


def profile(job: JobConfig, hardware: Hardware, world: int | None = None) -> MachineProfile:
    """The machine profile of `world` (default: the job's) such GPUs, on the job's nodes."""
    world = world or job.world_size
    return spec_profile(hardware.spec, world, max(1, world // job.cluster.nodes_for(world)), hardware.efficiency)


def memory_gib(job: JobConfig, hardware: Hardware) -> float:
    """Memory per device the predictions are checked against: autotune.device_memory_gib, else the file's GPU's."""
    return job.autotune.device_memory_gib or hardware.spec.memory_gib


def prediction(job: JobConfig, hardware: Hardware, *, pp_rank: int | None = None) -> dict[str, Any]:
    """The job's predicted step and peak memory per device (of the ranks at pipeline position
    `pp_rank`, default the most loaded) on the file's GPUs, and the file's line."""
    from titan_exp.perf.memory import GpuMemory, predict_memory
    from titan_exp.perf.step import predict_step

    step = predict_step(job, profile(job, hardware), cuda=True)
    gpu = GpuMemory(architecture=hardware.spec.architecture)  # cuBLAS's workspace size
    memory = predict_memory(job, cuda=True, pp_rank=pp_rank, gpu=gpu)["total"]
    device = memory_gib(job, hardware)
    return {"hardware": hardware.line(), "device": hardware.spec.name, "step_s": step.step_s,
            "tokens_per_s_per_device": step.tokens_per_s_per_device, "breakdown_s": step.breakdown(),
            "memory_gib": memory, "device_memory_gib": device, "fits": memory <= device}


def prediction_line(p: dict[str, Any]) -> str:
    """One line: what `prediction` says."""
    b = p["breakdown_s"]
    return (f"predicted on {p['device']} (cluster.hardware): {p['step_s']:.4g} s/step (compute {b['compute']:.3g}, "
            f"exposed comm {b['exposed_comm']:.3g}, bubble {b['bubble']:.3g}, recompute {b['recompute']:.3g}), "
            f"{p['tokens_per_s_per_device']:,.0f} tokens/s/device; {p['memory_gib']:.2f} GiB per device of its "
            f"{p['device_memory_gib']:.2f} GiB ({'fits' if p['fits'] else 'DOES NOT FIT'})")
