"""What the controller would refuse, asked before anything is written: partitions, node sizes
and time limits (`preflight`, run by the launcher's cluster step). The rules that need no
controller are titan_exp.config.cluster's (validation gathers them)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import Optional

from titan_exp.cluster.slurm.follow import _run
from titan_exp.config import JobConfig


def _slurm_time_min(text: str) -> Optional[float]:
    """Minutes in a SLURM time limit ('UNLIMITED', 'MM', 'MM:SS', 'HH:MM:SS', 'D-HH[:MM[:SS]]')."""
    if text in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    else:
        h, m, s = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return int(days or 0) * 1440 + h * 60 + m + s / 60


@dataclass
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int


def _gpus(gres: str) -> int:
    total = 0
    for item in gres.split(","):
        fields = item.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def preflight(job: JobConfig) -> list[str]:
    """What the controller would refuse or never schedule, asked of the controller before
    submission: the partition exists, it has nnodes nodes (cluster.min_nodes, when set) with the
    tasks' CPUs, memory and GPUs, and its time limit allows cluster.timeout_min."""
    c = job.cluster
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return ["cluster.executor = 'slurm': sbatch/scontrol are not on PATH on this machine; "
                "submit from a SLURM login node, or use cluster=local"]
    partitions = _run("sinfo", "-h", "-o", "%P")
    if partitions.returncode:
        return [f"cluster.executor = 'slurm': the SLURM controller does not answer ({partitions.stderr.strip()})"]
    names = [p.strip() for p in partitions.stdout.split()]
    default = next((p[:-1] for p in names if p.endswith("*")), None)
    names = [p.rstrip("*") for p in names]
    partition = c.partition or default
    if partition is None:
        return ["cluster.partition = None: this cluster has no default partition; choose one of " + ", ".join(names)]
    if partition not in names:
        return [f"cluster.partition = {partition!r}: no such partition; this cluster has {', '.join(names)}"]
    shown = _run("scontrol", "show", "partition", partition, "--oneliner")
    fields = dict(kv.split("=", 1) for kv in shown.stdout.split() if "=" in kv)
    e: list[str] = []
    max_time = _slurm_time_min(fields.get("MaxTime", "UNLIMITED"))
    if max_time is not None and c.timeout_min > max_time:
        e.append(f"cluster.timeout_min = {c.timeout_min}: partition {partition!r} allows at most {max_time:g} "
                 "minutes; lower it (the job checkpoints and requeues itself at the limit)")
    nodes = [Node(n, int(cpus), int(mem), _gpus(gres)) for n, cpus, mem, gres in
             (line.split("|")
              for line in _run("sinfo", "-h", "-N", "-p", partition, "-o", "%N|%c|%m|%G").stdout.split())]
    max_nodes = fields.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and c.nnodes > int(max_nodes):
        e.append(f"cluster.nnodes = {c.nnodes}: partition {partition!r} allows at most {max_nodes} nodes per job")
    cpus = c.nproc_per_node * c.cpus_per_task
    needs = (  # (field, value, what a node needs, does this node have it)
        ("cluster.nproc_per_node", c.nproc_per_node, f"{c.nproc_per_node} tasks x {c.cpus_per_task} CPUs = {cpus} CPUs "
         "(lower the degrees per node or cluster.cpus_per_task, or use more nodes)", lambda n: n.cpus >= cpus),
        ("cluster.gpus_per_node", c.gpus_per_node, f"{c.gpus_per_node} GPUs", lambda n: n.gpus >= c.gpus_per_node),
        ("cluster.mem_gb", c.mem_gb, f"{c.mem_gb} GiB", lambda n: c.mem_gb is None or n.memory_mb >= c.mem_gb * 1024),
    )
    largest = (f"its largest node has {max(n.cpus for n in nodes)} CPUs, {max(n.gpus for n in nodes)} GPUs, "
               f"{max(n.memory_mb for n in nodes) // 1024} GiB" if nodes else "it has no nodes")
    for field, value, need, has in needs:
        if not any(has(n) for n in nodes):
            e.append(f"{field} = {value!r}: no node of partition {partition!r} has {need}; {largest}")
    if not e:
        fits = sum(all(has(n) for *_, has in needs) for n in nodes)
        field, least = ("cluster.min_nodes", c.min_nodes) if c.min_nodes is not None else ("cluster.nnodes", c.nnodes)
        if fits < least:  # with min_nodes the job starts on as few as that (--nodes=min-max)
            e.append(f"{field} = {least}: partition {partition!r} has {fits} node(s) with what each task "
                     f"group needs ({cpus} CPUs, {c.gpus_per_node} GPUs); lower {field}")
    return e
