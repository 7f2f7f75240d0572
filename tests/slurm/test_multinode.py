"""Multi-node SLURM jobs, end to end, on the namespaced cluster of `scripts/local_slurm.sh nodes`:
compute nodes tnode1..3, each a slurmd in its own network namespace with its own address, so a
2-node job's ranks rendezvous on the first node's address and talk gloo across a (virtual)
network. What only runs with more than one node runs here: the rendezvous address and port,
ranks numbered across nodes, one task per rank on each node, a requeue that lands on other
nodes, the code snapshot read from every node, a node lost mid-step.

Skipped without the `nodes` partition, unless TITAN_EXP_REQUIRE_SLURM=1 (CI) makes that a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import SMALL, launch_cli, logged_steps, losses_by_step, run_job
from slurm_jobs import hosts_by_rank, job_info, job_nodes, sjob, state, submit, wait_until

NODES = ["cluster.partition=nodes", "cluster.nnodes=2", "cluster.nproc_per_node=2", "training.local_batch_size=2"]
pytestmark = [pytest.mark.slurm, pytest.mark.multinode]


# Both members at once are 8 ranks on CI's 2 cores: the array of both runs with `-m slow`, HSDP
# alone by default (its replicate dim spans the nodes, its shard dim does not).
@pytest.mark.parametrize("layouts", [{"hsdp": "dp_replicate2 x dp_shard2"},
                                     pytest.param({"fsdp": "dp_shard4", "hsdp": "dp_replicate2 x dp_shard2"},
                                                  marks=pytest.mark.slow)], ids=["hsdp", "fsdp_and_hsdp_array"])
def test_two_node_jobs_match_one_process(nodes, tmp_path, reference, layouts):
    """A multirun of 2-node jobs is one job (or one array of them); FSDP over 4 ranks and HSDP whose
    replicate dim spans the nodes both give the one-process losses, with ranks 0-1 on one node and
    2-3 on another."""
    from titan_exp.cluster.slurm.follow import wait

    sweep = tmp_path / "sweep"
    out = launch_cli(["-m", "cluster=slurm", *SMALL, *NODES, f"parallelism={','.join(layouts)}",
                      f"hydra.sweep.dir={sweep}"])
    assert out.returncode == 0, out.stderr[-3000:]
    members = [str(i) for i in range(len(layouts))]
    ids = [job_info(sweep / m)["job_id"] for m in members]
    assert len({i.split("_")[0] for i in ids}) == 1  # one job, or one array of them
    wait([sjob(sweep / m) for m in members], poll_s=0.5)
    for member, mesh in zip(members, layouts.values()):
        summary = json.loads((sweep / member / "summary.json").read_text())
        assert summary["status"] == "ok", summary
        assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-5), member
        hosts = hosts_by_rank(sweep / member)
        assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and {hosts[0], hosts[2]} <= set(nodes), hosts
        log = (sweep / member / "logs" / "rank-2.log").read_text()
        assert f"titan_exp from {sweep / 'code' / 'titan_exp'}" in log and mesh in log  # the snapshot, on node 2


# Preemption (test_slurm) across two nodes: the heaviest composition here, run with `-m slow`.
@pytest.mark.slow
def test_two_node_preemption_requeues_onto_other_nodes_and_resumes(nodes, tmp_path):
    """Preempt a 2-node job with one of its nodes drained: it checkpoints at a step boundary,
    requeues, lands on a different pair of nodes (a new rendezvous address), resumes from the
    checkpoint and ends with the losses of an uninterrupted one-process run."""
    args = [*SMALL, "training.steps=16", "checkpoint=default", "checkpoint.interval=100"]
    code, local = run_job([*args, "cluster=debug"], tmp_path / "local")
    assert code == 0, local
    run_dir = tmp_path / "slurm"
    out = submit([*args, *NODES, "parallelism=fsdp"], run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    wait_until(lambda: logged_steps(run_dir) >= 3, 180, "three steps")
    first = job_nodes(run_dir)
    drained = first[0]  # the rendezvous node: the requeued job must find another
    subprocess.run(["scontrol", "update", f"NodeName={drained}", "State=DRAIN", "Reason=titan_exp test"], check=True)
    try:
        sjob(run_dir)._interrupt()
        wait_until(lambda: state(run_dir).startswith("PENDING"), 60, "the requeued job")
        subprocess.run(["scontrol", "update", f"JobId={job_info(run_dir)['job_id']}", "StartTime=now"], check=True)
        wait_until(lambda: state(run_dir).startswith("COMPLETED"), 240, "the resumed job")
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={drained}", "State=RESUME"], check=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    assert summary["start_step"] > 3
    assert set(hosts_by_rank(run_dir, 0).values()) == set(first)
    second = set(hosts_by_rank(run_dir, -1).values())
    assert len(second) == 2 and drained not in second
    assert losses_by_step(run_dir) == pytest.approx(local["losses"], abs=1e-5)


def test_lost_node_is_named(nodes, tmp_path):
    """The second node's ranks are killed mid-run (as when a node dies under its job step): the
    job ends, and the summary names the ranks and the node it lost, then what rank 0 saw."""
    from titan_exp.cluster.slurm.follow import refresh, wait
    from titan_exp.record import RunDir

    run_dir = tmp_path / "run"
    out = submit([*SMALL, *NODES, "parallelism=fsdp", "training.steps=2000"], run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    wait_until(lambda: logged_steps(run_dir) >= 2, 180, "two steps")
    victim = job_nodes(run_dir)[1]
    folder = job_info(run_dir)["folder"]
    pids = subprocess.run(["ip", "netns", "pids", victim], capture_output=True, text=True, check=True).stdout.split()
    ranks = [int(p) for p in pids if folder.encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 2, ranks
    for pid in ranks:
        os.kill(pid, signal.SIGKILL)
    wait([sjob(run_dir)], poll_s=0.5)
    summary = refresh(RunDir(run_dir))
    assert summary.status.value == "failed"
    assert summary.error.startswith(f"SLURM job {job_info(run_dir)['job_id']} lost rank(s) 2-3 on node {victim} "
                                    "(killed); rank 0 then: "), summary.error
    assert summary.slurm_state.startswith("FAILED")


def test_preflight_refuses_more_nodes_than_the_partition_has(nodes, tmp_path):
    out = submit([*SMALL, *NODES, "cluster.nnodes=4", "parallelism=fsdp", "training.global_batch_size=16"],
                 tmp_path / "run")
    assert out.returncode != 0
    assert f"cluster.nnodes = 4: partition 'nodes' has {len(nodes)} node(s)" in out.stdout + out.stderr
    assert not (tmp_path / "run" / "slurm_job.json").exists()
    # With cluster.min_nodes the job may start on that many (--nodes=min-max): enough nodes for it will do.
    from conftest import job_config

    from titan_exp.cluster.slurm.preflight import preflight

    elastic = ["cluster=slurm", "cluster.partition=nodes", "cluster.nproc_per_node=2", "cluster.elastic=true",
               "checkpoint=default"]
    assert preflight(job_config([*elastic, "cluster.nnodes=4", "cluster.min_nodes=2"])) == []
    assert preflight(job_config([*elastic, "cluster.nnodes=5", "cluster.min_nodes=4"])) == [
        f"cluster.min_nodes = 4: partition 'nodes' has {len(nodes)} node(s) with what each task group needs "
        "(2 CPUs, 0 GPUs); lower cluster.min_nodes"]


# Calibration (test_slurm runs it as a 1-node job) across two nodes: a composition, run with `-m slow`.
@pytest.mark.slow
def test_calibration_on_two_nodes_measures_both_links(nodes, tmp_path):
    """Calibration as a 2-node job: the profile (keyed by its node count) has every collective over
    groups inside a node and over groups of one rank per node, and the planner, given it, costs
    the mesh dims that span nodes with the second and says which they are."""
    import sys

    from conftest import REPO

    from titan_exp.perf.rates.profile import MachineProfile

    cluster = ["cluster=slurm", "cluster.partition=nodes", "cluster.nnodes=2", "cluster.nproc_per_node=2"]
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.calibrate", "model.n_layers=2", "training.seq_len=64",
                          *cluster, "cluster.wait=true", "--tiny", "--profile-dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (path,) = tmp_path.glob("*-w4-n2-*.json")
    profile = MachineProfile.from_dict(json.loads(path.read_text()))
    assert profile.key["nodes"] == 2
    ops = {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"}
    assert set(profile.collectives) == ops and set(profile.inter_node) == ops
    assert all(line(1 << 20) > 0 for by_g in profile.inter_node.values() for line in by_g.values())
    assert "all_reduce across nodes: 2 ranks" in out.stdout
    plan = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "model.n_layers=2", "training.seq_len=64",
                           "cluster.nnodes=2", "--world", "4", "--profile-dir", str(tmp_path), "--top", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert path.stem in plan.stdout and "| across nodes |" in plan.stdout
    (hsdp,) = [line for line in plan.stdout.splitlines() if "| dp_replicate2 x dp_shard2 |" in line]
    assert hsdp.endswith("| dp_replicate |"), hsdp  # the replicas are on different nodes, the shards are not
    assert "inter-node measurements" not in plan.stdout
