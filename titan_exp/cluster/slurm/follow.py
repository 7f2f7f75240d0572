"""Following a submitted job: its state from sacct/squeue, waiting for it, and bringing its run
record up to date when it ended without saying so itself (cancelled, time limit, node failure)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

import submitit

from titan_exp.record import FINAL, RunDir, RunSummary, Status


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


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


# srun's own line for each node whose tasks ended badly, in the batch script's stderr:
#   srun: error: tnode2: tasks 2-3: Killed
#   srun: error: tnode1: task 0: Exited with exit code 1
SRUN_TASKS = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<tasks>[\d,\-]+): (?P<how>.+)$", re.M)
# srun's line when it ends the step's other tasks (--kill-on-bad-exit, submit.sbatch_parameters):
#   srun: launch/slurm: _step_signal: Terminating StepId=183.0
# the tasks named after it were ended by srun: followers too.
SRUN_ENDS_STEP = re.compile(r"^srun: .*Terminat\w* StepId", re.M)


def lost_tasks(stderr: str) -> Optional[str]:
    """Which ranks, on which node, a job lost, from srun's lines: those that died of a signal or
    vanished with their node (a rank that raised, e.g. because a peer vanished, exits 1 and is a
    follower, not the cause; so is a rank srun ended once another had died). None when srun
    names no such task."""
    try:
        text = Path(stderr).read_text(errors="replace")
    except OSError:
        return None
    ended = SRUN_ENDS_STEP.search(text)
    text = text[:ended.start()] if ended else text
    lost = [f"rank(s) {m['tasks']} on node {m['node']} ({m['how'].strip().lower()})"
            for m in SRUN_TASKS.finditer(text) if not m["how"].startswith("Exited with exit code")]
    return "; ".join(lost) or None


def refresh(run_dir: RunDir) -> Optional[RunSummary]:
    """The run's summary, brought up to date with its SLURM job: a job that ended without a final
    summary (cancelled, killed at the time limit, failed before training started) gets one that
    says so, and a failed multi-rank job names the ranks and node it lost first. Without a
    recorded job, the summary as it is."""
    summary = run_dir.read_summary()
    # Final summaries stay as they are, except a failure not yet set beside its job's end (no
    # slurm_state): rank 0 wrote it, and srun may name the ranks the job lost.
    settled = (summary is not None and summary.status in FINAL
               and (summary.status != Status.failed or summary.slurm_state))
    if not run_dir.slurm_job.exists() or settled:
        return summary
    if shutil.which("sacct") is None:  # read on a machine outside the cluster
        return summary
    info = json.loads(run_dir.slurm_job.read_text())
    state = job_state(info["job_id"], info["folder"])
    if not finished(state):
        if summary and summary.status == Status.pending and state.startswith("RUNNING"):
            summary = summary.replace(status=Status.running)
        return summary
    summary = summary or RunSummary(status=Status.pending, run_dir=str(run_dir.path))
    kind = state.split()[0].upper()
    lost = lost_tasks(info["stderr"])
    where = " before training finished"
    if summary.interrupted_at_step is not None:
        saved = " (checkpoint written)" if summary.checkpoint_at_stop else " (no checkpoint: checkpoint.enable=false)"
        where = f" after step {summary.interrupted_at_step}{saved}"
    if kind == "CANCELLED":
        summary = summary.replace(
            status=Status.cancelled, slurm_state=state,
            error=f"SLURM job {info['job_id']} was cancelled ({state}){where}; "
                  f"relaunch with hydra.run.dir={run_dir.path} to resume")
    elif summary.status == Status.failed:  # rank 0 said why it stopped; say what it lost first
        error = f"SLURM job {info['job_id']} lost {lost}; rank 0 then: {summary.error}" if lost else summary.error
        summary = summary.replace(slurm_state=state, error=error)
    elif summary.status in (Status.pending, Status.running, Status.interrupted):
        reason = {"TIMEOUT": "reached its time limit", "NODE_FAIL": "lost a node", "PREEMPTED": "was preempted"}.get(
            kind, f"ended in state {state}")
        tail = _tail(info["stderr"])
        summary = summary.replace(
            status=Status.oom if kind == "OUT_OF_MEMORY" else Status.failed, slurm_state=state,
            error=f"SLURM job {info['job_id']} {reason}{where}" + (f": it lost {lost}" if lost else "")
                  + (f"; stderr: {tail}" if tail else ""))
    else:
        return summary
    run_dir.write_summary(summary)
    return summary
