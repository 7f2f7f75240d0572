"""SLURM through submitit, on a real single-node slurmctld (scripts/local_slurm.sh; .ci/run starts
it). Tests marked `slurm` submit real jobs with `python launch.py cluster=slurm ...`; they skip
where no controller answers, unless TITAN_EXP_REQUIRE_SLURM=1 (CI) makes that a failure.

The node has 2 CPUs, so 2-rank jobs run one after another.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO, SMALL, job_config, launch_cli, logged_steps, losses_by_step
from slurm_jobs import job_info, sjob, state, submit, wait_until

TWO_RANKS = [*SMALL, "parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"]


# --- on the controller --------------------------------------------------------------------------

@pytest.mark.slurm
def test_fsdp_job_matches_local_run(slurm, tmp_path, reference):
    """2 ranks (FSDP) as a SLURM job: same losses as the single-process run, from the code snapshot."""
    run_dir = tmp_path / "run"
    out = submit([*TWO_RANKS, "cluster.wait=true", "+cluster.env.TITAN_EXP_PROBE=probe"], run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert summary["slurm_job_id"] == job_info(run_dir)["job_id"]
    assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    # The ranks imported titan_exp from the run dir's snapshot, not from the checkout.
    assert f"titan_exp from {run_dir / 'code' / 'titan_exp'}" in (run_dir / "logs" / "rank-0.log").read_text()
    script = next((run_dir / "slurm").glob("*_submission.sh")).read_text()
    for line in ("#SBATCH --ntasks-per-node=2", "#SBATCH --signal=USR2@120", "#SBATCH --time=60",
                 "export OMP_NUM_THREADS=1", "export TITAN_EXP_PROBE=probe", f"export PYTHONPATH={run_dir / 'code'}"):
        assert line in script
    assert f"submitted SLURM job {summary['slurm_job_id']}" in out.stdout + out.stderr


@pytest.mark.slurm
def test_multirun_is_one_job_array(slurm, tmp_path):
    """Two members are queued as one array at once; each runs in its own run dir and the report
    follows them to ok."""
    from titan_exp.cluster.slurm.follow import wait
    from titan_exp.report import write_report

    sweep = tmp_path / "sweep"
    out = launch_cli(["-m", "cluster=slurm", *TWO_RANKS, "training.steps=3", "optimizer.lr=1e-3,3e-3",
                      f"hydra.sweep.dir={sweep}"])
    assert out.returncode == 0, out.stderr[-3000:]
    ids = [job_info(sweep / m)["job_id"] for m in ("0", "1")]
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_0", f"{array}_1"]
    assert "queued as SLURM job(s)" in out.stdout + out.stderr
    wait([sjob(sweep / "0"), sjob(sweep / "1")], poll_s=0.5)
    rows = {r["member"]: r for r in write_report(sweep, plots=False)}
    assert [rows[m]["status"] for m in ("0", "1")] == ["ok", "ok"]
    assert rows["0"]["losses"][-1] != rows["1"]["losses"][-1]  # the members differ in lr


@pytest.mark.slurm
def test_preemption_requeues_and_resumes(slurm, tmp_path):
    """SIGTERM + SIGUSR2 (submitit's simulated preemption) mid-run: every rank stops at a step
    boundary, checkpoints, the job requeues itself, resumes from the checkpoint and finishes with
    the losses of an uninterrupted run; wandb (offline) keeps one run id across both segments."""
    args = [*TWO_RANKS, "training.steps=16", "checkpoint=default", "checkpoint.interval=100",
            "metrics.enable_wandb=true"]
    local = tmp_path / "local"
    assert launch_cli([*args, f"hydra.run.dir={local}"]).returncode == 0
    run_dir = tmp_path / "slurm"
    out = submit(args, run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    wait_until(lambda: logged_steps(run_dir) >= 3, 120, "three steps")
    sjob(run_dir)._interrupt()
    wait_until(lambda: state(run_dir).startswith("PENDING"), 60, "the requeued job")
    subprocess.run(["scontrol", "update", f"JobId={job_info(run_dir)['job_id']}", "StartTime=now"], check=True)
    wait_until(lambda: state(run_dir).startswith("COMPLETED"), 180, "the resumed job")

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert summary["start_step"] > 3  # resumed from the checkpoint written when it stopped
    log = (run_dir / "logs" / "rank-0.log").read_text()
    # SIGTERM comes first, SIGUSR2 a moment later: the step boundary may see both or SIGTERM
    # alone; either way the job requeued (TrainTask waits for SIGUSR2 after a SIGTERM stop).
    assert "stopped by SIGTERM" in log and f"continues after step {summary['start_step'] - 1}" in log
    assert losses_by_step(run_dir) == pytest.approx(losses_by_step(local), abs=1e-5)
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and len({p.name.rsplit("-", 1)[1] for p in segments}) == 1


@pytest.mark.slurm
@pytest.mark.slow  # the two halves run by default: test_faults (the rendezvous), above (the requeue)
def test_preemption_at_the_rendezvous_requeues(slurm, tmp_path):
    """Rank 1 never joins (it hangs before the rendezvous) and the job is preempted while rank 0
    waits there: rank 0 stops waiting and requeues the job, as a preemption at a step boundary
    does, rather than holding its allocation until the init timeout."""
    run_dir = tmp_path / "run"
    out = submit([*TWO_RANKS, "comm.init_timeout_seconds=900", "+cluster.env.TITAN_EXP_FAULT='hang@0:1'"],
                 run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    try:
        rank0 = run_dir / "logs" / "rank-0.log"
        wait_until(lambda: rank0.exists() and "titan_exp from" in rank0.read_text(), 120, "rank 0 at the rendezvous")
        time.sleep(2)  # into torch's wait for rank 1
        sjob(run_dir)._interrupt()
        wait_until(lambda: state(run_dir).startswith("PENDING"), 90, "the requeued job")
    finally:
        subprocess.run(["scancel", job_info(run_dir)["job_id"]])
    log = rank0.read_text()
    assert "arrived while this rank was waiting for the other ranks at the rendezvous" in log, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] in ("interrupted", "cancelled") and "SIGUSR2" in summary["interrupted_by"], summary


@pytest.mark.slurm
def test_cancelled_job_says_so(slurm, tmp_path):
    """scancel while waiting: SIGTERM stops the ranks at a step boundary with a checkpoint, and the
    summary and exit code say the job was cancelled and how to resume it."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "launch.py", "cluster=slurm", "cluster.wait=true", *TWO_RANKS, "training.steps=500",
         "checkpoint=default", "checkpoint.interval=1000", f"hydra.run.dir={run_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: logged_steps(run_dir) >= 2, 120, "two steps")
        subprocess.run(["scancel", job_info(run_dir)["job_id"]], check=True)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "cancelled" and summary["slurm_state"].startswith("CANCELLED")
    assert summary["interrupted_by"] == ["SIGTERM"]
    assert f"after step {summary['interrupted_at_step']} (checkpoint written)" in summary["error"]
    assert (run_dir / "checkpoints" / f"step-{summary['interrupted_at_step']}" / "complete.json").exists()
    assert "run cancelled" in output and "resume" in output


def test_a_rank_lost_before_the_rendezvous_ends_the_job(slurm, tmp_path):
    """Rank 0 dies before it opens the rendezvous (as when its port is taken): srun ends the job's
    other task, which would otherwise wait out comm.init_timeout_seconds (15 minutes here) for it,
    and the summary names the rank the job lost."""
    run_dir = tmp_path / "run"
    try:
        proc = submit(["cluster.wait=true", *TWO_RANKS, "comm.init_timeout_seconds=900",
                       "+cluster.env.TITAN_EXP_FAULT='init@0:0'"], run_dir)
    finally:
        if (run_dir / "slurm_job.json").exists():
            subprocess.run(["scancel", job_info(run_dir)["job_id"]])
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["slurm_state"].startswith("FAILED")
    # rank 0 alone: rank 1, which srun then ended, is not named
    lost = r"before training finished: it lost rank\(s\) 0 on node \S+ \(killed\); stderr:"
    assert re.search(lost, summary["error"]), summary["error"]


def test_the_rendezvous_port_is_the_jobs_own_and_never_an_ephemeral_one():
    """Every task of a job draws the same port from its job id, below Linux's ephemeral range
    (32768-60999), which submitit's own draw (20000-60000) overlaps: an outgoing connection on the
    node then held the port, and rank 0 failed with EADDRINUSE (seen in CI, 2026-11-26)."""
    from titan_exp.cluster.slurm.submit import rendezvous_port

    ports = [rendezvous_port(str(job)) for job in range(1, 2001)] + [rendezvous_port("138_1")]
    assert 20000 <= min(ports) and max(ports) < 32768 and len(set(ports)) > 1500
    assert rendezvous_port("146") == rendezvous_port("146")


BAD_CLUSTER = [
    (["cluster.partition=gpu"], "cluster.partition = 'gpu': no such partition; this cluster has debug"),
    (["parallelism=fsdp", "cluster.nproc_per_node=4"],
     "cluster.nproc_per_node = 4: no node of partition 'debug' has 4 tasks"),
    (["cluster.cpus_per_task=8"], "cluster.nproc_per_node = 1: no node of partition 'debug' has 1 tasks x 8 CPUs"),
    (["cluster.mem_gb=100000"], "cluster.mem_gb = 100000: no node of partition 'debug' has 100000 GiB"),
    (["cluster.gpus_per_node=1"], "cluster.gpus_per_node = 1: no node of partition 'debug' has 1 GPUs"),
    (["parallelism=fsdp", "cluster.nnodes=2", "cluster.nproc_per_node=1"],
     "cluster.nnodes = 2: partition 'debug' has 1 node(s)"),
    (["cluster.timeout_min=0"], "cluster.timeout_min = 0: must be >= 1"),
]


@pytest.mark.slurm
@pytest.mark.parametrize("overrides,message", BAD_CLUSTER, ids=[m.split(":")[0] for _, m in BAD_CLUSTER])
def test_bad_cluster_config_refused_before_submission(slurm, tmp_path, caplog, overrides, message):
    from conftest import compose

    from titan_exp.launch import EXIT_INVALID, launch

    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    run_dir = tmp_path / "run"
    code = launch(compose(["cluster=slurm", *overrides]), str(run_dir))
    assert code == EXIT_INVALID
    assert message in caplog.text
    assert not run_dir.exists()
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before


@pytest.mark.slurm
def test_sbatch_refusal_is_reported(slurm, tmp_path):
    """What only sbatch knows (here a reservation that does not exist) fails the launch clearly."""
    out = submit([*SMALL, "+cluster.additional_parameters.reservation=nope"], tmp_path / "run")
    assert out.returncode == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "sbatch refused the job" in summary["error"] and "reservation is invalid" in summary["error"]


# --- without a controller -------------------------------------------------------------------------

@pytest.mark.quick
def test_sbatch_parameters_from_the_cluster_config():
    from titan_exp.cluster.slurm.submit import sbatch_parameters
    from titan_exp.validation import resolve

    job = resolve(job_config([
        "cluster=slurm", "parallelism=fsdp", "cluster.nnodes=2", "cluster.gpus_per_node=4", "cluster.partition=gpu",
        "cluster.account=lab", "cluster.qos=high", "cluster.timeout_min=240", "cluster.constraint=a100",
        "cluster.exclude=node3", "cluster.cpus_per_task=8", "cluster.mem_gb=400", "cluster.mail_user=me@lab.org",
        "cluster.mail_type='END,FAIL'", "cluster.name=llama", "cluster.srun_args=['--cpu-bind=none']",
        "+cluster.additional_parameters.reservation=big",
    ]))
    assert job.cluster.nproc_per_node == 4  # one rank per GPU: 8 ranks on 2 nodes
    assert sbatch_parameters(job.cluster) == {
        "job_name": "llama", "nodes": 2, "ntasks_per_node": 4, "cpus_per_task": 8, "time": 240,
        "signal_delay_s": 120, "array_parallelism": 256, "additional_parameters": {"reservation": "big"},
        "srun_args": ["--cpu-bind=none", "--kill-on-bad-exit=1"], "partition": "gpu", "account": "lab", "qos": "high",
        "constraint": "a100", "exclude": "node3", "mail_user": "me@lab.org", "mail_type": "END,FAIL",
        "mem": "400G", "gpus_per_node": 4,
    }
    kept = resolve(job_config(["cluster=slurm", "cluster.srun_args=['--kill-on-bad-exit=0']"]))
    assert sbatch_parameters(kept.cluster)["srun_args"] == ["--kill-on-bad-exit=0"]  # the user's own choice


@pytest.mark.parametrize("overrides,message", [
    (["cluster.signal_delay_s=3600"], "cluster.signal_delay_s = 3600: the warning signal would come before"),
    (["cluster.gpus_per_node=8", "cluster.nproc_per_node=4"], "cluster.nproc_per_node = 4: one rank per GPU"),
    (["cluster.mail_type=SOMETIMES"], "cluster.mail_type = 'SOMETIMES': unknown event(s) ['SOMETIMES']"),
    (["cluster.mem_gb=0"], "cluster.mem_gb = 0: must be >= 1"),
    (["+cluster.env={BAD-NAME: x}"], "cluster.env = ['BAD-NAME']: environment variable names"),
])
@pytest.mark.quick
def test_static_cluster_errors(overrides, message):
    from titan_exp.validation import validate

    errors = validate(job_config(["cluster=slurm", *overrides]))
    assert any(message in e for e in errors), errors


def test_slurm_time_limits_parse():
    from titan_exp.cluster.slurm.preflight import _slurm_time_min

    assert _slurm_time_min("UNLIMITED") is None
    assert _slurm_time_min("30") == 30
    assert _slurm_time_min("1:30:00") == 90
    assert _slurm_time_min("2-00:00:00") == 2880
    assert _slurm_time_min("1-12") == 36 * 60


@pytest.mark.quick
def test_code_snapshot_is_a_copy_of_the_package(tmp_path):
    from titan_exp.cluster.slurm.submit import PACKAGE, snapshot_code

    code = snapshot_code(tmp_path)
    copied = {p.relative_to(code / "titan_exp") for p in (code / "titan_exp").rglob("*.py")}
    assert copied == {p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")}
    assert not list(code.rglob("__pycache__"))
    (code / "titan_exp" / "marker").write_text("")
    assert snapshot_code(tmp_path) == code and (code / "titan_exp" / "marker").exists()  # made once per root


def test_wandb_id_follows_the_run_dir(tmp_path):
    from titan_exp.metrics import wandb_run_id

    assert wandb_run_id(tmp_path / "a") == wandb_run_id(tmp_path / "a" / ".." / "a")
    assert wandb_run_id(tmp_path / "a") != wandb_run_id(tmp_path / "b")


@pytest.mark.slurm
@pytest.mark.slow  # calibration x SLURM: each is tested alone in the default tier
def test_calibration_runs_on_the_cluster(slurm, tmp_path):
    """`python -m titan_exp.perf.calibrate cluster=slurm` measures on the cluster's nodes: the same
    calibration ranks, started as a SLURM job; the profile lands where the nodes write it."""
    run_dir, profiles = tmp_path / "run", tmp_path / "profiles"
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.calibrate", "model.n_layers=2", "training.seq_len=64",
                          "cluster=slurm", "cluster.wait=true", "--world", "2", "--tiny", "--profile-dir",
                          str(profiles), "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "with the slurm executor" in out.stdout and "block tp=2" in out.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["slurm_job_id"] == job_info(run_dir)["job_id"]
    (profile,) = profiles.glob("*-w2-*.json")
    assert summary["machine_profile"] == str(profile)
