"""Stopping a run with a signal: every rank stops at the same step boundary, writes a checkpoint,
the summary says `interrupted` and the launcher exits with 3, every process of the run gone within
seconds; relaunching resumes with the losses of a run that was never stopped. A launcher killed
with kill -9 takes its ranks with it, each leaving the checkpoint of the step it stopped at."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, SMALL, launch_cli, logged_steps, losses_by_step, rank_pids

ARGS = [*SMALL, "training.steps=12", "parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4",
        "checkpoint=default", "checkpoint.interval=100"]
ONE_RANK = [*SMALL, "training.steps=12", "cluster.nproc_per_node=1", "training.local_batch_size=8",
            "checkpoint=default", "checkpoint.interval=100"]
# From the ranks' stop (their checkpoint written) until the launcher and every rank have exited.
# Measured from the stop, not from the signal: the step in progress at the signal runs to its end
# first, which on a loaded machine alone can take longer.
ENDED_WITHIN_S = 10


def start_training(args: list[str], run_dir: Path) -> tuple[subprocess.Popen, list[int]]:
    """`python launch.py ARGS` once it has logged 2 steps, and the pids of its ranks."""
    proc = subprocess.Popen([sys.executable, "launch.py", *args, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while logged_steps(run_dir) < 2:
        assert time.time() < deadline and proc.poll() is None, "the run did not start"
        time.sleep(0.1)
    return proc, rank_pids(run_dir)


def signal_launcher(args: list[str], run_dir: Path, sig: int) -> tuple[int, str, float, list[int]]:
    """Send `sig` to the launcher of a run that has trained 2 steps: its exit code, its output, the
    seconds from the ranks' stop until it and its ranks had exited (until_ended), and its ranks
    still alive then."""
    proc, pids = start_training(args, run_dir)
    try:
        proc.send_signal(sig)
        output, seconds = until_ended(proc, pids)
        return proc.returncode, output, seconds, live_ranks(pids)
    finally:
        end_leftovers(proc, pids)


def until_ended(proc: subprocess.Popen, pids: list[int]) -> tuple[str, float]:
    """The launcher's whole output, and the seconds from the first rank's "stopped by" line until
    the launcher and its ranks had exited: inf when no rank stopped or that took over a minute.
    Returns once every process of the run has exited: the output closes only then (the forkserver
    and the resource tracker hold it too)."""
    lines: list[str] = []
    stopped: list[float] = []

    def read() -> None:
        for line in proc.stdout:
            if "stopped by" in line and not stopped:
                stopped.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while (proc.poll() is None or live_ranks(pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    ended = time.monotonic()
    reader.join(max(0.0, deadline - ended))
    if reader.is_alive() or not stopped or ended >= deadline:
        return "".join(lines), math.inf
    return "".join(lines), ended - stopped[0]


def end_leftovers(proc: subprocess.Popen, pids: list[int]) -> None:
    """Kill what a failing test would leave running: the launcher, ranks that outlived it."""
    proc.kill()
    for pid in live_ranks(pids):
        os.kill(pid, signal.SIGKILL)


def live_ranks(pids: list[int]) -> list[int]:
    """Those of `pids` that are still a rank process (`titan-rank-N`), not exited nor a zombie."""
    alive = []
    for pid in pids:
        try:
            comm, stat = Path(f"/proc/{pid}/comm").read_text(), Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if comm.startswith("titan-rank") and stat.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(pid)
    return alive


def assert_ended_cleanly(code: int, output: str, seconds: float, alive: list[int]) -> None:
    """Exit code 3, the launcher and its ranks gone within ENDED_WITHIN_S, and no rank left for
    torch's agent to SIGKILL (which it does after 30 s) nor semaphores left behind."""
    assert code == 3, output[-3000:]
    assert not alive and seconds < ENDED_WITHIN_S, f"{seconds:.1f} s, ranks {alive} alive\n{output[-3000:]}"
    assert "forcefully exiting" not in output and "leaked semaphore" not in output, output[-3000:]


def assert_stopped_with_a_checkpoint(run_dir: Path, sig_name: str, steps: int = 12) -> int:
    """The summary says the run was interrupted by `sig_name`, at a step whose checkpoint is complete;
    that step."""
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["interrupted_at_step"]
    assert summary["status"] == "interrupted" and summary["interrupted_by"] == [sig_name]
    assert 2 <= stopped < steps
    assert (run_dir / "checkpoints" / f"step-{stopped}" / "complete.json").exists()
    return stopped


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    out = launch_cli([*ARGS, f"hydra.run.dir={run_dir}"])
    assert out.returncode == 0, out.stderr[-2000:]
    return losses_by_step(run_dir)


# SIGINT takes SIGTERM's path (torch's elastic agent passes either on to the ranks, whose
# titan_exp.signals.catch_stop_signals stops on either): slow, for CI's time.
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_to_launcher_stops_at_a_step_boundary_and_resumes(tmp_path, uninterrupted, sig):
    run_dir = tmp_path / "run"
    code, output, seconds, alive = signal_launcher(ARGS, run_dir, sig)
    assert_ended_cleanly(code, output, seconds, alive)
    stopped = assert_stopped_with_a_checkpoint(run_dir, sig.name)
    assert f"run interrupted by {sig.name} after step {stopped}" in output

    out = launch_cli([*ARGS, f"hydra.run.dir={run_dir}"])  # resume
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["start_step"] == stopped + 1
    assert losses_by_step(run_dir) == pytest.approx(uninterrupted, abs=1e-6)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_a_one_rank_launcher_ends_every_process_within_seconds(tmp_path, sig):
    """The rank, forked from the launcher's forkserver, exits once its checkpoint is written: it
    does not wait for torch's agent, which is shutting down, to collect its result."""
    code, output, seconds, alive = signal_launcher(ONE_RANK, tmp_path, sig)
    assert_ended_cleanly(code, output, seconds, alive)
    assert_stopped_with_a_checkpoint(tmp_path, sig.name)


def test_kill_9_of_the_launcher_stops_its_ranks_at_a_step_boundary(tmp_path):
    """Nothing tells the ranks (torch's agent died with the launcher): each sees the launcher's
    process end (signals.stop_with_launcher), stops at the next step boundary as for SIGTERM, with a
    checkpoint and rank 0's summary, and exits within ENDED_WITHIN_S of that stop."""
    proc, pids = start_training(ARGS, tmp_path)
    assert len(pids) == 2
    try:
        proc.kill()
        output, seconds = until_ended(proc, pids)
        alive = live_ranks(pids)
    finally:
        end_leftovers(proc, pids)
    assert not alive and seconds < ENDED_WITHIN_S, f"{seconds:.1f} s, ranks {alive} alive\n{output[-3000:]}"
    assert_stopped_with_a_checkpoint(tmp_path, "SIGTERM")
    assert "the launcher (pid" in (tmp_path / "logs" / "rank-1.log").read_text()


@pytest.mark.quick
def test_a_stop_signal_ends_a_wait_that_holds_the_main_thread():
    """stoppable: a stop signal during the wait raises Stopped at once; without one, the wait's
    result or its exception comes back as if called directly."""

    from titan_exp.signals import Stopped, catch_stop_signals, stoppable

    with catch_stop_signals():
        assert stoppable(lambda: 7, "adding") == 7
        with pytest.raises(ZeroDivisionError):
            stoppable(lambda: 1 / 0, "dividing")
        never = threading.Event()
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        # Stopped comes only while the wait is still on (a finished wait returns its result)
        with pytest.raises(Stopped, match="SIGTERM arrived while this rank was waiting for nothing"):
            stoppable(lambda: never.wait(60), "waiting for nothing")
