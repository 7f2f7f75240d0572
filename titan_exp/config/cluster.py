"""The cluster group's rules and what it derives: `check` (every executor's rules, and SLURM's
that need no controller), the threads a local rank gets, and the environment every rank starts
with. The executors that start the ranks are titan_exp.cluster's; these sit beside the schema so
that validation, the planner and the executors read them without importing one another.
"""

from __future__ import annotations

import os
import re

from titan_exp.config.fields import Executor, problem
from titan_exp.config.schema import ClusterConfig, JobConfig

# A secret's name has one of these as a whole word (HF_TOKEN, WANDB_API_KEY; not TOKENIZERS_PARALLELISM,
# NCCL_IB_HCA); a secret's value looks like a key whatever its name (a known token prefix, or a long
# run of letters and digits with no path or space in it).
SECRET_WORDS = {"KEY", "KEYS", "APIKEY", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "CREDENTIAL",
                "CREDENTIALS"}
SECRET_VALUE = re.compile(r"^(sk-|hf_|ghp_|gho_|github_pat_|xox[abp]-|AKIA[0-9A-Z]{16})"
                          r"|^(?=.*\d)(?=.*[A-Za-z])[\w\-]{32,}$")


def looks_secret(name: str, value: object) -> bool:
    return bool(SECRET_WORDS & set(name.upper().split("_"))) or bool(SECRET_VALUE.search(str(value)))
MAIL_TYPES = {"NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS"}


def check(job: JobConfig, cuda: bool) -> list[str]:
    """Rules of every executor, then SLURM's own (check_slurm)."""
    e: list[str] = []
    c = job.cluster
    if c.cpu_malloc_mmap_threshold_mib is not None and not 0 <= c.cpu_malloc_mmap_threshold_mib <= 32:
        e.append(problem("cluster.cpu_malloc_mmap_threshold_mib", c.cpu_malloc_mmap_threshold_mib,
                         "glibc accepts 0..32 MiB; or null for its default"))
    if c.nproc_per_node is not None and c.nproc_per_node < 1:
        e.append(problem("cluster.nproc_per_node", c.nproc_per_node,
                         "must be >= 1, or null to derive it from the degrees"))
        return e + check_slurm(job)
    if c.nproc_per_node is None and job.world_size % c.nnodes:
        e.append(problem("cluster.nnodes", c.nnodes,
                         f"does not divide the {job.world_size} ranks the degrees need; set cluster.nproc_per_node"))
    if c.dry_run and c.dry_run_rank >= job.world_size:
        e.append(problem("cluster.dry_run_rank", c.dry_run_rank, f"the layout has ranks 0..{job.world_size - 1}"))
    if c.dry_run:
        return e + check_slurm(job)  # one rank, here: the rules below are about starting every rank
    if cuda and c.executor == Executor.local and c.nproc_per_node is not None:
        import torch

        visible = torch.cuda.device_count()
        if c.nproc_per_node > visible:
            e.append(problem("cluster.nproc_per_node", c.nproc_per_node,
                             f"one rank per GPU, and this machine shows {visible} (CUDA_VISIBLE_DEVICES); "
                             f"use at most {visible}"))
    if c.elastic and not job.checkpoint.enable:
        e.append(problem("cluster.elastic", True, "an elastic run continues from its checkpoints, and "
                         "checkpoint.enable is false; set checkpoint=default (or checkpoint.enable=true)"))
    if c.executor == Executor.debug and job.world_size != 1:
        e.append(problem("cluster.executor", c.executor,
                         f"runs one rank in-process but the world size is {job.world_size}; use cluster=local"))
    return e + check_slurm(job)


def check_slurm(job: JobConfig) -> list[str]:
    """What sbatch would reject, or what would make the job misbehave, known without asking the
    controller (titan_exp.cluster.slurm.preflight asks it about partitions and node sizes)."""
    c = job.cluster
    if c.executor != Executor.slurm:
        return [problem("cluster.min_nodes", c.min_nodes, "SLURM only (cluster=slurm); a local run's world is "
                        "cluster.nproc_per_node")] if c.min_nodes is not None else []
    e: list[str] = []
    for name, low in (("timeout_min", 1), ("cpus_per_task", 1), ("gpus_per_node", 0), ("signal_delay_s", 0),
                      ("max_num_timeout", 0), ("array_parallelism", 1)):
        if getattr(c, name) < low:
            e.append(problem(f"cluster.{name}", getattr(c, name), f"must be >= {low}"))
    if c.min_nodes is not None and not 1 <= c.min_nodes <= c.nnodes:
        e.append(problem("cluster.min_nodes", c.min_nodes, f"must be 1..cluster.nnodes = {c.nnodes}, or null"))
    elif c.min_nodes is not None and c.min_nodes < c.nnodes and not c.elastic:
        e.append(problem("cluster.min_nodes", c.min_nodes, "a job on fewer nodes needs a layout for them; "
                         "set cluster.elastic=true (the run re-plans on the nodes it gets)"))
    if c.mem_gb is not None and c.mem_gb < 1:
        e.append(problem("cluster.mem_gb", c.mem_gb,
                         "must be >= 1 (GiB per node), or null for the partition's default"))
    if c.timeout_min >= 1 and c.signal_delay_s >= c.timeout_min * 60:
        e.append(problem("cluster.signal_delay_s", c.signal_delay_s,
             f"the warning signal would come before the job starts (time limit {c.timeout_min} min); lower it"))
    if c.gpus_per_node > 0 and c.nproc_per_node is not None and c.nproc_per_node != c.gpus_per_node:
        e.append(problem("cluster.nproc_per_node", c.nproc_per_node,
             f"one rank per GPU: must equal cluster.gpus_per_node = {c.gpus_per_node}, or null"))
    if c.mail_type is not None:
        unknown = [t for t in c.mail_type.split(",") if t.strip().upper() not in MAIL_TYPES]
        if unknown:
            e.append(problem("cluster.mail_type", c.mail_type,
                             f"unknown event(s) {unknown}; choose from {sorted(MAIL_TYPES)}"))
    secrets = [k for k, v in c.env.items() if looks_secret(k, v)]
    if secrets:
        e.append(problem("cluster.env", secrets,
                         "looks like a secret, and the config is written to the run dir and the job script; export "
                         "it in the shell that runs launch.py instead (sbatch passes that environment on)"))
    bad_env = [k for k in c.env if not k.isidentifier()]
    if bad_env:
        e.append(problem("cluster.env", bad_env,
                         "environment variable names are letters, digits and _, not starting with a digit"))
    return e


def threads_per_rank(nproc: int) -> int:
    """OMP threads each local rank gets: the user's OMP_NUM_THREADS, else an even split of the cores."""
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // nproc))


CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def rank_env(c: ClusterConfig, *, threads: int, gpu: bool) -> dict[str, str]:
    """Environment of every rank, local or on SLURM: its share of the cores; on a CPU rank a
    fixed glibc mmap threshold, on a GPU rank the caching allocator's settings (cuda_alloc_conf).
    With glibc's default (a threshold that rises to the largest buffer freed, up to 32 MiB),
    FSDP's per-block all-gather and reduce-scatter buffers come from the heap, fragment it, and a
    rank's resident memory grows to about twice what it uses (BENCHMARKS.md). The user's own
    MALLOC_* setting wins."""
    env = {"OMP_NUM_THREADS": str(threads)}
    if not gpu and c.cpu_malloc_mmap_threshold_mib is not None and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env["MALLOC_MMAP_THRESHOLD_"] = str(c.cpu_malloc_mmap_threshold_mib * 2**20)
    if gpu and (conf := cuda_alloc_conf(c)):
        env[CUDA_ALLOC_CONF] = conf
    return env


def cuda_alloc_conf(c: ClusterConfig) -> str | None:
    """The caching allocator's settings for a GPU rank, unless the user set their own: with
    cluster.cuda_expandable_segments, segments that grow in place. On one H200 the default allocator
    reserved 0.3-6.6 GiB beyond its allocated peak, up to 18 % of the reserved
    peak under eager activation checkpointing (BENCHMARKS.md), which the memory model does not
    price."""
    if c.cuda_expandable_segments and CUDA_ALLOC_CONF not in os.environ:
        return "expandable_segments:True"
    return None
