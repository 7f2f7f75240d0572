"""What the job would be refused for, before anything is written: static rules (`check`, which
validation gathers) and the controller's answer about partitions, node sizes and time limits
(`preflight`, run by the launcher's cluster step)."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from typing import Optional

from titan_exp.cluster.slurm.follow import _run
from titan_exp.config import Executor, JobConfig, problem

# A secret's name has one of these as a whole word (HF_TOKEN, WANDB_API_KEY; not TOKENIZERS_PARALLELISM,
# NCCL_IB_HCA); a secret's value looks like a key whatever its name (a known token prefix, or a long
# run of letters and digits with no path or space in it).
SECRET_WORDS = {"KEY", "KEYS", "APIKEY", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL",
                "CREDENTIALS"}
SECRET_VALUE = re.compile(r"^(sk-|hf_|ghp_|gho_|github_pat_|xox[abp]-|AKIA[0-9A-Z]{16})|^(?=.*\d)(?=.*[A-Za-z])[\w\-]{32,}$")


def looks_secret(name: str, value: object) -> bool:
    return bool(SECRET_WORDS & set(name.upper().split("_"))) or bool(SECRET_VALUE.search(str(value)))
MAIL_TYPES = {"NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS"}


def check(job: JobConfig, cuda: bool) -> list[str]:
    """What sbatch would reject, or what would make the job misbehave, known without asking the
    controller (`preflight` asks it about partitions and node sizes)."""
    c = job.cluster
    if c.executor != Executor.slurm:
        return []
    e: list[str] = []
    for name, low in (("timeout_min", 1), ("cpus_per_task", 1), ("gpus_per_node", 0), ("signal_delay_s", 0),
                      ("max_num_timeout", 0), ("array_parallelism", 1)):
        if getattr(c, name) < low:
            e.append(problem(f"cluster.{name}", getattr(c, name), f"must be >= {low}"))
    if c.mem_gb is not None and c.mem_gb < 1:
        e.append(problem("cluster.mem_gb", c.mem_gb, "must be >= 1 (GiB per node), or null for the partition's default"))
    if c.timeout_min >= 1 and c.signal_delay_s >= c.timeout_min * 60:
        e.append(problem("cluster.signal_delay_s", c.signal_delay_s,
             f"the warning signal would come before the job starts (time limit {c.timeout_min} min); lower it"))
    if c.gpus_per_node > 0 and c.nproc_per_node is not None and c.nproc_per_node != c.gpus_per_node:
        e.append(problem("cluster.nproc_per_node", c.nproc_per_node,
             f"one rank per GPU: must equal cluster.gpus_per_node = {c.gpus_per_node}, or null"))
    if c.mail_type is not None:
        unknown = [t for t in c.mail_type.split(",") if t.strip().upper() not in MAIL_TYPES]
        if unknown:
            e.append(problem("cluster.mail_type", c.mail_type, f"unknown event(s) {unknown}; choose from {sorted(MAIL_TYPES)}"))
    secrets = [k for k, v in c.env.items() if looks_secret(k, v)]
    if secrets:
        e.append(problem("cluster.env", secrets, "looks like a secret, and the config is written to the run dir and the job "
             "script; export it in the shell that runs launch.py instead (sbatch passes that environment on)"))
    bad_env = [k for k in c.env if not k.isidentifier()]
    if bad_env:
        e.append(problem("cluster.env", bad_env, "environment variable names are letters, digits and _, not starting with a digit"))
    return e


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
    submission: the partition exists, it has nnodes nodes with the tasks' CPUs, memory and GPUs,
    and its time limit allows cluster.timeout_min."""
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
             (line.split("|") for line in _run("sinfo", "-h", "-N", "-p", partition, "-o", "%N|%c|%m|%G").stdout.split())]
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
        if fits < c.nnodes:
            e.append(f"cluster.nnodes = {c.nnodes}: partition {partition!r} has {fits} node(s) with what each task "
                     f"group needs ({cpus} CPUs, {c.gpus_per_node} GPUs); lower cluster.nnodes")
    return e
