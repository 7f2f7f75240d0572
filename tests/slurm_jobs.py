"""What the SLURM tests (test_slurm, test_multinode, test_elastic) share: whether a controller and
the namespaced `nodes` partition answer (conftest's `slurm` and `nodes` fixtures ask), submitting a
job as a user does, and reading what SLURM and the run directory say of it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from conftest import launch_cli


def slurm_up() -> bool:
    if shutil.which("scontrol") is None:
        return False
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return "UP" in ping.stdout


def submit(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    return launch_cli(["cluster=slurm", *args, f"hydra.run.dir={run_dir}"])


def job_info(run_dir: Path) -> dict:
    return json.loads((run_dir / "slurm_job.json").read_text())


def sjob(run_dir: Path):
    import submitit

    info = job_info(run_dir)
    return submitit.SlurmJob(folder=info["folder"], job_id=info["job_id"])


def state(run_dir: Path) -> str:
    from titan_exp.cluster.slurm.follow import job_state

    info = job_info(run_dir)
    return job_state(info["job_id"], info["folder"])


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def partition_nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "nodes", "-o", "%N %T"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines() if re.search(r"idle|mixed|allocated", line)]


def hosts_by_rank(run_dir: Path, segment: int = -1) -> dict[int, str]:
    """The host each rank ran on, from its log ("... on host tnode2"); `segment` picks the start
    (a requeued job's ranks append a second one)."""
    out = {}
    for log in (run_dir / "logs").glob("rank-*.log"):
        hosts = re.findall(r"titan_exp from \S+, on host (\S+)", log.read_text())
        out[int(log.stem.split("-")[1])] = hosts[segment]
    return out


def job_nodes(run_dir: Path) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-j", job_info(run_dir)["job_id"], "-o", "%N"], capture_output=True,
                         text=True, check=True).stdout.strip()
    return subprocess.run(["scontrol", "show", "hostnames", out], capture_output=True, text=True,
                          check=True).stdout.split()
