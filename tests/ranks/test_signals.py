"""Stopping a run with a signal: every rank stops at the same step boundary, writes a checkpoint,
the summary says `interrupted` and the launcher exits with 3; relaunching resumes with the losses
of a run that was never stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, SMALL, launch_cli, logged_steps, losses_by_step

ARGS = [*SMALL, "training.steps=12", "parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4",
        "checkpoint=default", "checkpoint.interval=100"]


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
    proc = subprocess.Popen([sys.executable, "launch.py", *ARGS, f"hydra.run.dir={run_dir}"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while logged_steps(run_dir) < 2:
            assert time.time() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.1)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["interrupted_at_step"]
    assert summary["status"] == "interrupted" and summary["interrupted_by"] == [sig.name]
    assert 2 <= stopped < 12
    assert (run_dir / "checkpoints" / f"step-{stopped}" / "complete.json").exists()
    assert f"run interrupted by {sig.name} after step {stopped}" in output

    out = launch_cli([*ARGS, f"hydra.run.dir={run_dir}"])  # resume
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["start_step"] == stopped + 1
    assert losses_by_step(run_dir) == pytest.approx(uninterrupted, abs=1e-6)


@pytest.mark.quick
def test_a_stop_signal_ends_a_wait_that_holds_the_main_thread():
    """stoppable: a stop signal during the wait raises Stopped at once; without one, the wait's
    result or its exception comes back as if called directly."""
    import os
    import threading

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
