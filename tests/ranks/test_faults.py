"""Faults: a rank that hangs or dies, NaN losses, and a soak of kill -9s at random moments. Real
multi-process gloo runs; faults come from TITAN_EXP_FAULT (titan_exp/faults.py) or from outside."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, SMALL, launch_cli, logged_steps, losses_by_step, rank_pids, run_job

TWO = [*SMALL, "parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_hung_rank_ends_the_run_and_is_named(tmp_path, monkeypatch):
    """Rank 1 hangs outside any collective: rank 0 times out in its collective (comm timeout),
    rank 1's step watchdog dumps its stack, and the summary names rank 1."""
    monkeypatch.setenv("TITAN_EXP_FAULT", "hang@3:1")
    code, summary = run_job([*TWO, "comm.train_timeout_seconds=5"], tmp_path)
    assert code == 1 and summary["status"] == "failed"
    assert summary["hung_ranks"] == [1]
    assert summary["error"].startswith("rank(s) 1 hung (their step watchdog fired")
    assert "Timed out" in summary["error"]  # what rank 0's collective said
    log = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "Timeout (0:00:10)!" in log and "in inject" in log  # the stack shows where it hung


def test_dead_rank_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_EXP_FAULT", "step@2:1")
    code, summary = run_job(TWO, tmp_path)
    assert code == 1 and summary["status"] == "failed"
    assert summary["error"].startswith("rank 1 was killed by SIGKILL; rank 0 then: ")


def test_a_rank_lost_before_the_rendezvous_stops_the_one_waiting_there(tmp_path, monkeypatch):
    """Rank 1 dies before it joins: the agent's SIGTERM ends rank 0's wait at the rendezvous (which
    runs in C++, where Python runs no signal handler), so rank 0 exits and writes the summary
    itself, instead of being SIGKILLed 30 s later with the summary left to the launcher."""
    monkeypatch.setenv("TITAN_EXP_FAULT", "init@0:1")
    code, summary = run_job([*TWO, "comm.init_timeout_seconds=300"], tmp_path)
    assert code == 1 and summary["status"] == "failed"
    assert summary["error"].startswith("rank 1 was killed by SIGKILL; rank 0 then: Stopped: SIGTERM arrived while "
                                       "this rank was waiting for the other ranks at the rendezvous")
    assert summary["model"] == "debugmodel"  # rank 0's summary, not the launcher's stand-in


def test_abort_after_a_successful_run_is_not_a_failure(tmp_path, monkeypatch):
    """gloo sometimes aborts a rank in teardown after training finished; the run is ok."""
    monkeypatch.setenv("TITAN_EXP_FAULT", "exit@0:1")
    code, summary = run_job(TWO, tmp_path)
    assert code == 0 and summary["status"] == "ok"
    assert "ending this rank" in (tmp_path / "logs" / "rank-1.log").read_text()


@pytest.mark.quick
def test_nan_stops_before_the_update_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    from titan_exp.checkpoint import complete_steps

    monkeypatch.setenv("TITAN_EXP_FAULT", "nan@3")
    code, summary = run_job([*SMALL, "cluster=debug", "checkpoint=default", "checkpoint.interval=1"], tmp_path)
    assert code == 1 and summary["status"] == "failed"
    assert summary["error"].startswith("FloatingPointError: step 3: loss nan, gradient norm nan: not finite, stopped")
    assert "the latest checkpoint stays step-2" in summary["error"]
    assert sorted(complete_steps(tmp_path / "checkpoints")) == [1, 2]


def test_nan_found_at_a_later_read_still_saves_nothing_after_it(tmp_path, monkeypatch):
    """With on_nonfinite=stop the host reads losses only where it needs them (StepHistory): here
    at the step-4 checkpoint, not at step 3. The NaN is found there, before step 4 is saved."""
    from titan_exp.checkpoint import complete_steps

    monkeypatch.setenv("TITAN_EXP_FAULT", "nan@3")
    code, summary = run_job([*SMALL, "cluster=debug", "checkpoint=default", "checkpoint.interval=2",
                             "metrics.log_freq=10"], tmp_path)
    assert code == 1 and summary["status"] == "failed"
    assert summary["error"].startswith("FloatingPointError: step 3: loss nan, gradient norm nan: not finite, "
                                       "stopped at step 4's read of the device")
    assert "the latest checkpoint stays step-2" in summary["error"]
    assert sorted(complete_steps(tmp_path / "checkpoints")) == [2]


def test_nan_on_one_rank_is_skipped_by_every_rank(tmp_path, monkeypatch):
    """training.on_nonfinite=skip: rank 1's NaN reaches every rank through the global gradient
    norm, so all skip the same update, and the run goes on with finite losses."""
    monkeypatch.setenv("TITAN_EXP_FAULT", "nan@3:1")
    code, summary = run_job([*TWO, "training.steps=6", "training.on_nonfinite=skip"], tmp_path)
    assert code == 0, summary
    assert summary["skipped_steps"] == [3]
    losses = summary["losses"]
    assert losses[2] != losses[2] and all(x == x for x in losses[:2] + losses[3:])  # NaN only at step 3
    assert "the update was skipped" in (tmp_path / "logs" / "rank-0.log").read_text()


def test_ten_skips_in_a_row_stop(tmp_path):
    code, summary = run_job([*SMALL, "cluster=debug", "training.steps=12", "training.on_nonfinite=skip",
                             "optimizer.lr=1e30", "lr_scheduler.warmup_steps=0", "training.max_norm=0"], tmp_path)
    assert code == 1 and "10 steps in a row were skipped" in summary["error"]


# --- the soak test ---------------------------------------------------------------------------------

SOAK = [*SMALL, "training.steps=30", "parallelism=fsdp", "cluster.nproc_per_node=4", "training.local_batch_size=2",
        "checkpoint=default", "checkpoint.interval=2", "checkpoint.keep_latest_k=2"]
KILLS = 10


def latest_step(run_dir: Path) -> int:
    from titan_exp.checkpoint import complete_steps

    return max(complete_steps(run_dir / "checkpoints"), default=0)


@pytest.mark.slow  # about 3 minutes on 2 cores; the default tier keeps test_checkpoint's kill -9 tests
def test_soak_kill9_at_random_moments_then_resume(tmp_path):
    """kill -9 one rank of a 4-rank run ten times, relaunching after each: half at a random moment
    (from outside, any rank), half while a checkpoint is being written (TITAN_EXP_FAULT=save,
    after the rank's shard, before the marker). Every complete checkpoint stays verifiable, and the
    losses of the whole run equal those of a run that was never killed."""
    from titan_exp.checkpoint import complete_steps, incomplete_dirs, step_dir, verify

    rng = random.Random(8)
    clean = tmp_path / "clean"
    assert launch_cli([*SOAK, f"hydra.run.dir={clean}"]).returncode == 0
    run_dir, log = tmp_path / "soak", []
    for kill in range(KILLS):
        env = dict(os.environ)
        during_save = kill % 2 == 1
        if during_save:  # the next save after the latest complete checkpoint, on a random rank
            save_step = latest_step(run_dir) + 2
            env["TITAN_EXP_FAULT"] = f"save@{save_step}:{rng.randrange(4)}"
        proc = subprocess.Popen([sys.executable, "launch.py", *SOAK, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not during_save:
            start = logged_steps(run_dir)
            deadline = time.time() + 120
            while logged_steps(run_dir) <= start:  # training has started again
                assert time.time() < deadline and proc.poll() is None, "the relaunch did not train"
                time.sleep(0.05)
            time.sleep(rng.uniform(0, 1.5))
            victims = rank_pids(run_dir)
            assert victims, "no rank to kill"
            os.kill(rng.choice(victims), signal.SIGKILL)
        assert proc.wait(timeout=300) != 0, f"kill {kill} came too late: the run finished"
        unmarked = len(incomplete_dirs(run_dir / "checkpoints"))  # a save cut short, removed at the relaunch
        log.append((kill, "save" if during_save else "random", latest_step(run_dir), unmarked))
        for step in complete_steps(run_dir / "checkpoints"):
            assert verify(step_dir(run_dir / "checkpoints", step)) is None
    out = launch_cli([*SOAK, f"hydra.run.dir={run_dir}"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert losses_by_step(run_dir) == pytest.approx(losses_by_step(clean), abs=1e-6), log
    print("soak (kill, how, latest complete step, unmarked dirs):", log)
