"""Submitting runs with submitit: one task per rank, nnodes x nproc_per_node tasks, a copy of
the package for the ranks to import, and one job array per set of sbatch options for a sweep."""

from __future__ import annotations

import json
import logging
import os
import random
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import submitit
from hydra.experimental.callback import Callback

from titan_exp import signals
from titan_exp.cluster.env import TRAIN
from titan_exp.cluster.slurm.follow import refresh
from titan_exp.cluster.slurm.follow import wait as wait_for
from titan_exp.config import ClusterConfig, JobConfig, load_job_config
from titan_exp.config.cluster import rank_env
from titan_exp.record import RunDir, RunSummary, Status, sweep_members

logger = logging.getLogger("titan_exp.slurm")

PACKAGE = Path(__file__).resolve().parents[2]  # the titan_exp package being run


PREEMPTION_GRACE_S = 10.0  # well inside SLURM's KillWait (30 s by default)


class TrainTask(submitit.helpers.Checkpointable):
    """One rank of a run: `<entry>.main(run_dir)` (the trainer, titan_exp.train.rank, unless
    told otherwise) with the rendezvous from SLURM.
    Checkpointable: on requeue submitit resubmits this same object; resuming is the trainer's job
    (it loads the run dir's latest checkpoint), so the task carries nothing but the run dir."""

    def __init__(self, run_dir: str, entry: str = TRAIN):
        self.run_dir = run_dir
        self.entry = entry

    def __call__(self) -> Optional[dict[str, Any]]:
        import importlib

        rank = importlib.import_module(self.entry)

        os.environ.setdefault("MASTER_PORT", str(rendezvous_port(submitit.JobEnvironment().job_id)))
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        with signals.catch_stop_signals():  # kept on after training, until the requeue below
            try:
                rank.main(self.run_dir)
            except signals.Stopped as stopped:  # at the rendezvous: a preemption requeues, a cancel fails
                if not preempted(stopped.names):
                    raise
                if dist_env.rank == 0:  # it wrote `failed`; the requeued job goes on
                    run_dir = RunDir(self.run_dir)
                    by = list(dict.fromkeys([*stopped.names, "SIGUSR2"]))  # SIGUSR2 may have come after
                    if (summary := run_dir.read_summary()) is not None:
                        run_dir.write_summary(summary.replace(status=Status.interrupted, interrupted_by=by))
                    requeue()
                return None
            summary = RunDir(self.run_dir).read_summary() if dist_env.rank == 0 else None
            if summary is not None and preempted(summary.interrupted_by or []):
                # Checkpointed at a step boundary.
                if not summary.checkpoint_at_stop:
                    logger.warning("checkpoint.enable=false: nothing was saved, so the requeued job trains "
                                   "again from step 1")
                requeue()
        return summary.to_dict() if summary else None


def preempted(stopped_by: list[str]) -> bool:
    """Whether a run stopped by these signals was preempted (requeue) rather than cancelled. A
    preemption sends SIGTERM, then SIGUSR2 (submitit's simulation does the same, as two scancel
    calls): a stop between them saw SIGTERM alone, so a stop on SIGTERM waits a moment for
    SIGUSR2 before calling it a cancel."""
    return "SIGUSR2" in stopped_by or (
        "SIGTERM" in stopped_by and signals.wait_for(signal.SIGUSR2, PREEMPTION_GRACE_S))


def requeue() -> None:
    """submitit's own SIGUSR2 handler (which catch_stop_signals set aside): it requeues the job
    and exits."""
    signals.previous_handler(signal.SIGUSR2)(signal.SIGUSR2, None)


def rendezvous_port(job_id: str) -> int:
    """Rank 0's rendezvous port, the same on every task of the job: drawn from the job id, as
    submitit draws it, but below Linux's ephemeral ports (32768 and up), where submitit's range
    (20000-60000) lets an outgoing connection of any process on the node already hold it (its
    TCPStore then fails with EADDRINUSE, and the other ranks wait out their init timeout)."""
    return random.Random(job_id).randint(20000, 32767)


def sbatch_parameters(c: ClusterConfig) -> dict[str, Any]:
    """submitit.SlurmExecutor parameters (sbatch options) for a resolved cluster config, without
    the per-submission setup lines."""
    given = {
        "partition": c.partition, "account": c.account, "qos": c.qos, "constraint": c.constraint,
        "exclude": c.exclude, "mail_user": c.mail_user, "mail_type": c.mail_type,
        "mem": f"{c.mem_gb}G" if c.mem_gb else None,
        "gpus_per_node": c.gpus_per_node or None,
    }
    params = {
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
    if not any(a.startswith(("--kill-on-bad-exit", "-K")) for a in c.srun_args):
        # A task that dies ends the job's other tasks (SIGTERM, then SIGKILL after KillWait), as
        # torchrun's agent does: a rank 0 lost before it opens the rendezvous would leave the
        # others waiting out comm.init_timeout_seconds for it.
        params["srun_args"].append("--kill-on-bad-exit=1")
    if c.min_nodes is not None and c.min_nodes < c.nnodes:
        # sbatch's --nodes=min-max (submitit's own `nodes` must be a number: it multiplies it into
        # the task count), each node with its ranks' CPUs, and srun, not sbatch, starting
        # nproc_per_node tasks on each: a job with --ntasks-per-node keeps the task count of its
        # first allocation when SLURM requeues it (22.05), so it could not start on fewer nodes.
        del params["ntasks_per_node"]
        params["additional_parameters"] |= {"nodes": f"{c.min_nodes}-{c.nnodes}",
                                            "mincpus": c.nproc_per_node * c.cpus_per_task}
        params["srun_args"].append(f"--ntasks-per-node={c.nproc_per_node}")
    return params


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


def _setup_lines(job: JobConfig, code: Path, run_dir: RunDir) -> list[str]:
    """The user's setup, the ranks' environment, and the snapshot first on the path. The ranks
    start in the snapshot's parent: `python -m` puts the working directory first on sys.path, so
    starting in a checkout would import its titan_exp instead (paths in the config are absolute).
    With cluster.elastic, each start of the job (a requeue too) first fits the run's layout to the
    nodes it got (titan_exp.cluster.elastic), so such a member is a job of its own, not in an array."""
    c = job.cluster
    lines = list(c.setup)
    env = {**rank_env(c, threads=c.cpus_per_task, gpu=c.gpus_per_node > 0), **c.env}  # the user's values win
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
    lines.append(f"export PYTHONPATH={shlex.quote(str(code))}${{PYTHONPATH:+:$PYTHONPATH}}")
    lines.append(f"cd {shlex.quote(str(code.parent))}")
    if c.elastic:
        replan = f"{shlex.quote(sys.executable)} -m titan_exp.cluster.elastic {shlex.quote(str(run_dir.path))}"
        lines.append(f"{replan} || exit 1")  # refused: the summary says why, no rank starts
    return lines


def submit(runs: list[tuple[JobConfig, RunDir]], root: Path, entry: str = TRAIN) -> list[submitit.Job]:
    """Submit the runs from `root` (a run dir, or a sweep dir for its members): one job, or one
    job array for each set of identical sbatch options. Records each job in its run dir."""
    code = snapshot_code(root)
    groups: dict[str, list[tuple[JobConfig, RunDir]]] = {}
    for job, run_dir in runs:
        key = json.dumps({**sbatch_parameters(job.cluster), "setup": _setup_lines(job, code, run_dir),
                          "max_num_timeout": job.cluster.max_num_timeout}, sort_keys=True)
        groups.setdefault(key, []).append((job, run_dir))
    jobs: list[submitit.Job] = []
    for key, members in groups.items():
        params = json.loads(key)
        executor = submitit.SlurmExecutor(folder=root / "slurm", max_num_timeout=params.pop("max_num_timeout"))
        executor.update_parameters(**params)
        try:
            with executor.batch():
                submitted = [executor.submit(TrainTask(str(run_dir.path), entry)) for _, run_dir in members]
        except Exception as exc:  # noqa: BLE001 - sbatch's refusal, named below
            raise SubmitError(f"sbatch refused the job ({_first_line(exc)}); nothing was queued") from exc
        for (job, run_dir), sjob in zip(members, submitted):
            _record_submission(run_dir, job, sjob, code)
        jobs += submitted
    return jobs


class SubmitError(RuntimeError):
    pass


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [type(exc).__name__])[-1].strip()


def _write_pending(run_dir: RunDir, job: JobConfig, **fields: str) -> None:
    run_dir.write_summary(RunSummary.of(job, Status.pending, run_dir.path, **fields))


def _record_submission(run_dir: RunDir, job: JobConfig, sjob: submitit.Job, code: Path) -> None:
    info = {"job_id": sjob.job_id, "folder": str(sjob.paths.folder), "stdout": str(sjob.paths.stdout),
            "stderr": str(sjob.paths.stderr), "code": str(code), "submitted": time.time()}
    run_dir.slurm_job.write_text(json.dumps(info, indent=2))
    _write_pending(run_dir, job, slurm_job_id=sjob.job_id)
    logger.info("submitted SLURM job %s | run dir %s | logs %s (rank 0; %%t = rank)", sjob.job_id, run_dir.path,
                sjob.paths.stdout)


def run_slurm(job: JobConfig, run_dir: RunDir, *, in_sweep: bool = False, entry: str = TRAIN) -> Optional[str]:
    """The executor: queue the job and return; with cluster.wait, wait for it and return its
    error, if any. A sweep member is only recorded as pending here: SlurmArrayCallback submits
    the sweep's pending members together, as job arrays, once the sweep is composed."""
    if in_sweep:
        _write_pending(run_dir, job)
        return None
    try:
        (sjob,) = submit([(job, run_dir)], run_dir.path, entry)
    except SubmitError as exc:
        run_dir.write_summary(RunSummary.of(job, Status.failed, run_dir.path, error=str(exc)))
        return str(exc)
    if not job.cluster.wait:
        return None
    wait_for([sjob])
    summary = refresh(run_dir)
    if summary is None:
        return "job ended without a summary"
    return None if summary.status == Status.ok else summary.error


class SlurmArrayCallback(Callback):
    """At the end of a multirun: submits the members the executor left pending (a pending summary
    and no slurm_job.json yet) as job arrays. conf/config.yaml registers it after the report
    callback, and Hydra calls end hooks in reverse, so the report sees the submitted jobs."""

    def on_multirun_end(self, config, **kwargs) -> None:
        submit_pending(Path(config.hydra.sweep.dir))


def submit_pending(sweep: Path, wait: bool | None = None) -> None:
    """Submit a sweep's members that the SLURM executor left pending (a pending summary and no
    slurm_job.json yet) as job arrays; then wait for them if `wait` (default: cluster.wait)."""
    if not sweep.is_dir():
        return
    runs = []
    for run_dir in sweep_members(sweep):
        summary = run_dir.read_summary()
        if summary is not None and summary.status == Status.pending and not run_dir.slurm_job.exists():
            runs.append((load_job_config(run_dir.config), run_dir))
    if not runs:
        return
    try:
        jobs = submit(runs, sweep)
    except SubmitError as exc:
        logger.error("%s", exc)
        for _, run_dir in runs:
            run_dir.write_summary(run_dir.read_summary().replace(status=Status.failed, error=str(exc)))
        return
    logger.info("sweep %s: %d member(s) queued as SLURM job(s) %s", sweep, len(jobs),
                ", ".join(sorted({j.job_id.split("_")[0] for j in jobs})))
    if wait or (wait is None and any(job.cluster.wait for job, _ in runs)):
        wait_for(jobs)
        for _, run_dir in runs:
            refresh(run_dir)
