"""SLURM through submitit: one task per rank, nnodes x nproc_per_node tasks.

    python launch.py cluster=slurm cluster.nnodes=4 cluster.gpus_per_node=8 parallelism=3d

The launcher validates and writes the run dir as for a local run; then this module
  1. asks the controller whether the partition can hold the job (`preflight`), before anything
     is written,
  2. copies the titan_exp package into `<root>/code` and puts it first on the ranks' PYTHONPATH,
     so a queued job runs the code as it was at submission, whatever happens to the checkout,
  3. submits `TrainTask(run_dir)` with submitit, records the job in `<run dir>/slurm_job.json`,
     writes a `pending` summary, prints the job id and log paths and returns (cluster.wait=true
     waits and returns the result).

On the nodes each task takes its rank and the rendezvous (first node, a port derived from the
job id) from submitit's TorchDistributedEnvironment and runs `titan_exp.train.main`, like a
local rank. SLURM's warning signal (SIGUSR2, `cluster.signal_delay_s` before the time limit, or
on preemption) stops every rank at a step boundary with a checkpoint (titan_exp.signals); rank 0
then hands over to submitit's own handler, which requeues the job (TrainTask is Checkpointable).
The requeued job runs the same task on the same run dir, and the trainer resumes from its latest
checkpoint.

A multirun (`-m`) with cluster=slurm submits its members together as job arrays (one per set of
sbatch options) when the sweep has been composed (SlurmArrayCallback), without waiting.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import submitit
from hydra.experimental.callback import Callback

from titan_exp.cluster import cpu_rank_env
from titan_exp.config import ClusterConfig, JobConfig
from titan_exp.run_dir import FINAL, RunDir

logger = logging.getLogger("titan_exp.slurm")

PACKAGE = Path(__file__).resolve().parents[1]  # the titan_exp package being run


# --- what runs on the nodes ---------------------------------------------------------------------

class TrainTask(submitit.helpers.Checkpointable):
    """One rank of a run: `titan_exp.train.main(run_dir)` with the rendezvous from SLURM.
    Checkpointable: on requeue submitit resubmits this same object; resuming is the trainer's job
    (it loads the run dir's latest checkpoint), so the task carries nothing but the run dir."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> Optional[dict[str, Any]]:
        from titan_exp import signals, train

        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        with signals.catch_stop_signals():  # kept on after training, until the requeue below
            train.main(self.run_dir)
            summary = RunDir(self.run_dir).read_summary() if dist_env.rank == 0 else None
            if summary and "SIGUSR2" in summary.get("interrupted_by", []):
                # Checkpointed at a step boundary; submitit's handler now requeues and exits.
                if "checkpoint_blocking_s" not in summary:  # the trainer saves on a stop when enabled
                    logger.warning("checkpoint.enable=false: nothing was saved, so the requeued job trains "
                                   "again from step 1")
                submitit_handler = signals.previous_handler(signal.SIGUSR2)
                submitit_handler(signal.SIGUSR2, None)
        return summary


# --- submission ---------------------------------------------------------------------------------

def rank_env(c: ClusterConfig) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": str(c.cpus_per_task)}
    if c.gpus_per_node == 0:
        env.update(cpu_rank_env(c.cpu_malloc_mmap_threshold_mib))
    return {**env, **c.env}  # the user's values win


def sbatch_parameters(c: ClusterConfig) -> dict[str, Any]:
    """submitit.SlurmExecutor parameters (sbatch options) for a resolved cluster config, without
    the per-submission setup lines."""
    given = {
        "partition": c.partition, "account": c.account, "qos": c.qos, "constraint": c.constraint,
        "exclude": c.exclude, "mail_user": c.mail_user, "mail_type": c.mail_type,
        "mem": f"{c.mem_gb}G" if c.mem_gb else None,
        "gpus_per_node": c.gpus_per_node or None,
    }
    return {
        "job_name": c.name,
        "nodes": c.nnodes,
        "ntasks_per_node": c.nproc_per_node,
        "cpus_per_task": c.cpus_per_task,
        "time": c.timeout_min,
        "signal_delay_s": c.signal_delay_s,
        "array_parallelism": c.array_parallelism,
        "additional_parameters": dict(c.additional_parameters),
        "srun_args": list(c.srun_args),
        **{k: v for k, v in given.items() if v is not None},
    }


def snapshot_code(root: Path) -> Path:
    """A copy of the titan_exp package under `root/code`, which the ranks import instead of the
    checkout. (submitit's RsyncSnapshot does this for a git checkout with rsync and a chdir; a
    copy of the package also works for a plain pip install and leaves the caller's cwd alone.)"""
    code = root / "code"
    if not (code / "titan_exp").is_dir():
        tmp = root / ".code.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(PACKAGE, tmp / "titan_exp", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        os.replace(tmp, code)
    return code


def _setup_lines(job: JobConfig, code: Path) -> list[str]:
    """The user's setup, the ranks' environment, and the snapshot first on the path. The ranks
    start in the snapshot's parent: `python -m` puts the working directory first on sys.path, so
    starting in a checkout would import its titan_exp instead (paths in the config are absolute)."""
    c = job.cluster
    lines = list(c.setup)
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in rank_env(c).items()]
    lines.append(f"export PYTHONPATH={shlex.quote(str(code))}${{PYTHONPATH:+:$PYTHONPATH}}")
    lines.append(f"cd {shlex.quote(str(code.parent))}")
    return lines


def submit(runs: list[tuple[JobConfig, RunDir]], root: Path) -> list[submitit.Job]:
    """Submit the runs from `root` (a run dir, or a sweep dir for its members): one job, or one
    job array for each set of identical sbatch options. Records each job in its run dir."""
    code = snapshot_code(root)
    groups: dict[str, list[tuple[JobConfig, RunDir]]] = {}
    for job, record in runs:
        key = json.dumps({**sbatch_parameters(job.cluster), "setup": _setup_lines(job, code),
                          "max_num_timeout": job.cluster.max_num_timeout}, sort_keys=True)
        groups.setdefault(key, []).append((job, record))
    jobs: list[submitit.Job] = []
    for key, members in groups.items():
        params = json.loads(key)
        executor = submitit.SlurmExecutor(folder=root / "slurm", max_num_timeout=params.pop("max_num_timeout"))
        executor.update_parameters(**params)
        try:
            with executor.batch():
                submitted = [executor.submit(TrainTask(str(record.path))) for _, record in members]
        except Exception as exc:  # noqa: BLE001 - sbatch's refusal, named below
            raise SubmitError(f"sbatch refused the job ({_first_line(exc)}); nothing was queued") from exc
        for (job, record), sjob in zip(members, submitted):
            _record_submission(record, job, sjob, code)
        jobs += submitted
    return jobs


class SubmitError(RuntimeError):
    pass


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [type(exc).__name__])[-1].strip()


def _write_pending(record: RunDir, job: JobConfig, **extra: str) -> None:
    from titan_exp.train import describe

    record.write_summary({"status": "pending", "run_dir": str(record.path), **describe(job), **extra})


def _record_submission(record: RunDir, job: JobConfig, sjob: submitit.Job, code: Path) -> None:
    info = {"job_id": sjob.job_id, "folder": str(sjob.paths.folder), "stdout": str(sjob.paths.stdout),
            "stderr": str(sjob.paths.stderr), "code": str(code), "submitted": time.time()}
    record.slurm_job.write_text(json.dumps(info, indent=2))
    _write_pending(record, job, slurm_job_id=sjob.job_id)
    logger.info("submitted SLURM job %s | run dir %s | logs %s (rank 0; %%t = rank)", sjob.job_id, record.path,
                sjob.paths.stdout)


# --- the executor and the multirun batch --------------------------------------------------------

_batch: Optional[list[tuple[JobConfig, RunDir]]] = None  # set while a multirun composes its members


def run_slurm(job: JobConfig, run_dir: RunDir) -> Optional[str]:
    """The executor: queue the job (or, inside a multirun, add it to the sweep's array) and return;
    with cluster.wait, wait for it and return its error, if any."""
    if _batch is not None:
        _batch.append((job, run_dir))
        _write_pending(run_dir, job)
        return None
    try:
        (sjob,) = submit([(job, run_dir)], run_dir.path)
    except SubmitError as exc:
        run_dir.write_summary({"status": "failed", "run_dir": str(run_dir.path), "error": str(exc)})
        return str(exc)
    if not job.cluster.wait:
        return None
    wait([sjob])
    summary = refresh(run_dir)
    return None if summary and summary["status"] == "ok" else (summary or {}).get("error", "job ended without a summary")


class SlurmArrayCallback(Callback):
    """Collects the members of a multirun that use cluster=slurm and submits them as job arrays
    once the sweep is composed (conf/config.yaml registers it after the report callback, and Hydra
    calls end hooks in reverse, so the report sees the submitted jobs)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        global _batch
        _batch = []

    def on_multirun_end(self, config, **kwargs) -> None:
        global _batch
        runs, _batch = _batch or [], None
        if not runs:
            return
        sweep = Path(config.hydra.sweep.dir)
        try:
            jobs = submit(runs, sweep)
        except SubmitError as exc:
            logger.error("%s", exc)
            for _, record in runs:
                record.write_summary({**(record.read_summary() or {}), "status": "failed", "error": str(exc)})
            return
        logger.info("sweep %s: %d member(s) queued as SLURM job(s) %s", sweep, len(jobs),
                    ", ".join(sorted({j.job_id.split("_")[0] for j in jobs})))
        if any(job.cluster.wait for job, _ in runs):
            wait(jobs)
            for _, record in runs:
                refresh(record)


# --- following a job ------------------------------------------------------------------------------

def job_state(job_id: str, folder: str | Path) -> str:
    """SLURM's state of the job from sacct, freshly read ("UNKNOWN" before sacct knows it).
    sacct says CANCELLED as soon as scancel runs, while the ranks are still stopping (and
    checkpointing); until squeue lets go of the job, it is COMPLETING."""
    info = submitit.SlurmJob(folder=folder, job_id=job_id).get_info(mode="force")
    state = info.get("State") or "UNKNOWN"
    if finished(state):
        queued = _run("squeue", "-h", "-j", job_id, "-o", "%T")
        if queued.returncode == 0 and queued.stdout.strip():
            return "COMPLETING"
    return state


def finished(state: str) -> bool:
    return state.split()[0].upper() not in ("READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING",
                                            "PREEMPTED", "CONFIGURING", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED")


def wait(jobs: list[submitit.Job], poll_s: float = 1.0, max_poll_s: float = 30.0) -> None:
    """Until every job has ended (through requeues), reading sacct afresh: submitit's own wait
    reads it once every 10 minutes unless a result file appears, which a cancelled job never writes."""
    pending = list(jobs)
    while pending:
        pending = [j for j in pending if not finished(job_state(j.job_id, j.paths.folder))]
        if pending:
            time.sleep(poll_s)
            poll_s = min(max_poll_s, poll_s * 1.2)


def _tail(path: str, lines: int = 5) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def refresh(run_dir: RunDir) -> Optional[dict[str, Any]]:
    """The run's summary, brought up to date with its SLURM job: a job that ended without a final
    summary (cancelled, killed at the time limit, failed before training started) gets one that
    says so. Without a recorded job, the summary as it is."""
    summary = run_dir.read_summary()
    if not run_dir.slurm_job.exists() or (summary and summary["status"] in FINAL):
        return summary
    if shutil.which("sacct") is None:  # read on a machine outside the cluster
        return summary
    info = json.loads(run_dir.slurm_job.read_text())
    state = job_state(info["job_id"], info["folder"])
    if not finished(state):
        if summary and summary["status"] == "pending" and state.startswith("RUNNING"):
            summary = {**summary, "status": "running"}
        return summary
    summary = dict(summary or {"run_dir": str(run_dir.path)})
    kind = state.split()[0].upper()
    where = " before training finished"
    if "interrupted_at_step" in summary:
        saved = "checkpoint_blocking_s" in summary  # the trainer saves when it stops, if checkpointing
        where = f" after step {summary['interrupted_at_step']}" + (" (checkpoint written)" if saved else " (no checkpoint: checkpoint.enable=false)")
    if kind == "CANCELLED":
        summary.update(status="cancelled", error=f"SLURM job {info['job_id']} was cancelled ({state}){where}; "
                       f"relaunch with hydra.run.dir={run_dir.path} to resume", slurm_state=state)
    elif summary.get("status") in ("pending", "running", "interrupted"):
        status = "oom" if kind == "OUT_OF_MEMORY" else "failed"
        reason = {"TIMEOUT": "reached its time limit", "NODE_FAIL": "lost a node", "PREEMPTED": "was preempted"}.get(
            kind, f"ended in state {state}")
        tail = _tail(info["stderr"])
        summary.update(status=status, slurm_state=state,
                       error=f"SLURM job {info['job_id']} {reason}{where}" + (f"; stderr: {tail}" if tail else ""))
    else:
        return summary
    run_dir.write_summary(summary)
    return summary


# --- checks against the controller, before anything is written ----------------------------------

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


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


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
