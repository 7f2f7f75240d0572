"""cluster.elastic (issue 40): a checkpointed run relaunched on a world size its layout cannot use
continues in the planner's layout for the new world, with the losses, learning rates and data
of a run that was never interrupted (fp32, deterministic, the same global batch: 1e-5, as any two
layouts agree); and what cannot be re-planned is refused before any process starts.

The SLURM case (a 3-node job that loses a node and is requeued onto the other 2) is at the end,
in test_multinode.py's style: marked `slurm`, `multinode` and `slow`, it needs `bash
scripts/local_slurm.sh nodes 3`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from conftest import SMALL, run_job

ELASTIC = [*SMALL, "checkpoint=default", "checkpoint.interval=3", "cluster.elastic=true"]
FSDP2_TP2 = ["parallelism.data_parallel_shard_degree=2", "parallelism.tensor_parallel_degree=2",
             "cluster.nproc_per_node=4", "training.local_batch_size=4"]


def ok(code, summary):
    assert code == 0 and summary["status"] == "ok", summary and summary.get("error")
    return summary


def learning_rates(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())}


def replanned_to(caplog, world: int) -> str:
    """The launcher's line for the re-plan to `world` ranks."""
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"re-planned for world {world}: ")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    return lines[0]


def relaunched_on_fewer_ranks(before: list[str], run_dir: Path, caplog, reference) -> tuple[dict, str]:
    """Train SMALL's 5 steps in the layout `before` (checkpoints at 3 and 5), relaunch the same run
    dir on 2 ranks from step 3; the second segment must continue the uninterrupted one-process
    run exactly (its losses, learning rates and so its data and schedule). Returns its summary
    and the re-plan line."""
    first = ok(*run_job([*ELASTIC, *before], run_dir))
    assert first["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    with caplog.at_level(logging.INFO, logger="titan_exp.launch"):
        second = ok(*run_job([*ELASTIC, *before, "cluster.nproc_per_node=2", "checkpoint.load_step=3"], run_dir))
    line = replanned_to(caplog, 2)
    assert second["start_step"] == 4 and second["world_size"] == 2
    assert second["losses"] == pytest.approx(reference["losses"][3:], abs=1e-5)
    assert second["grad_norms"] == pytest.approx(reference["grad_norms"][3:], abs=1e-5)
    assert second["global_batch_size"] == 8
    rates = learning_rates(run_dir)
    assert [rates[s] for s in (4, 5)] == pytest.approx([learning_rates(reference["run_dir"])[s] for s in (4, 5)])
    return second, line


FSDP2 = ["parallelism.pipeline_parallel_degree=1", "parallelism.data_parallel_shard_degree=2",
         "parallelism.tensor_parallel_degree=1", "cluster.nproc_per_node=2", "training.local_batch_size=4"]


def continued_in_fsdp(before: list[str], run_dir: Path, reference) -> list[dict]:
    """Relaunch the run dir from step 3 once more, in FSDP 2 on 2 ranks as the user names it (on
    this CPU the planner prefers another layout for 2 ranks; on GPUs FSDP is its usual answer):
    the change from `before`'s checkpoint into FSDP must continue the uninterrupted run exactly.
    Returns the run's layouts."""
    third = ok(*run_job([*ELASTIC, *before, *FSDP2, "checkpoint.load_step=3"], run_dir))
    assert third["start_step"] == 4 and third["layout"]["dp_shard"] == 2 and third["world_size"] == 2
    assert third["losses"] == pytest.approx(reference["losses"][3:], abs=1e-5)
    # FSDP's gradient norm sums its shards' squares in another order: the layouts' tolerance (test_parallel.py)
    assert third["grad_norms"] == pytest.approx(reference["grad_norms"][3:], rel=2e-4)
    assert third["layouts"][-1] == {"from_step": 3, "world": 2, "layout": third["layout"]}
    return third["layouts"]


def test_fsdp_tp_run_continues_on_half_the_ranks(tmp_path, caplog, reference):
    """FSDP 2 x TP 2 on 4 ranks, then 2 ranks: the planner's fastest layout for 2 (what it is
    depends on the machine's profile, so the test reads it from the run) from step 3's checkpoint."""
    from titan_exp.config import layout_label, load_job_config
    from titan_exp.record import LayoutSpan, RunDir

    second, line = relaunched_on_fewer_ranks(FSDP2_TP2, tmp_path, caplog, reference)
    spans = second["layouts"]
    assert [(s["from_step"], s["world"]) for s in spans] == [(0, 4), (3, 2)]
    assert spans[0]["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2}
    assert spans[1]["layout"] == second["layout"] and spans[1]["layout"] != spans[0]["layout"]
    assert line.startswith(f"re-planned for world 2: dp_shard2 x tp2 -> {layout_label(second['layout'])} (")
    assert RunDir(tmp_path).read_summary().layouts == [LayoutSpan(0, 4, spans[0]["layout"]),
                                                       LayoutSpan(3, 2, second["layout"])]  # typed, read back
    saved = load_job_config(tmp_path / "config.yaml")  # what a later relaunch or requeue starts from
    assert saved.world_size == 2 and saved.parallelism.layout == second["layout"]
    assert len(continued_in_fsdp(FSDP2_TP2, tmp_path, reference)) == 3  # FSDP x TP -> FSDP


@pytest.mark.slow
def test_pipeline_run_continues_on_half_the_ranks(tmp_path, caplog, reference):
    """PP 2 x FSDP 2 on 4 ranks, then 2 ranks without the 4-rank pipeline's stages."""
    before = ["parallelism.pipeline_parallel_degree=2", "parallelism.data_parallel_shard_degree=2",
              "cluster.nproc_per_node=4", "training.local_batch_size=4"]
    second, line = relaunched_on_fewer_ranks(before, tmp_path, caplog, reference)
    assert line.startswith("re-planned for world 2: pp2 x dp_shard2 -> ")
    assert [s["world"] for s in second["layouts"]] == [4, 2]
    assert [s["world"] for s in continued_in_fsdp(before, tmp_path, reference)] == [4, 2, 2]  # PP -> FSDP


# --- Refused before any process starts ------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (["cluster.elastic=true"], "cluster.elastic = True: an elastic run continues from its checkpoints, and "
                               "checkpoint.enable is false"),
    (["cluster.elastic=false", "checkpoint=default"],  # a fresh run: no checkpoint to re-plan from, no elastic hint
     "but the world size is 2 (cluster.nnodes=1 x cluster.nproc_per_node=2); make them equal or set "
     "data_parallel_shard_degree=-1\n"),
    (["cluster.elastic=true", "checkpoint=default", "autotune.device_memory_gib=0.01"],
     "cluster.nproc_per_node = 2: cluster.elastic: no layout of 2 ranks fits in memory: the model needs at "
     "least 0."),
    (["cluster.elastic=true", "checkpoint=default", "cluster.min_nodes=1"], "cluster.min_nodes = 1: SLURM only"),
])
def test_refused_with_the_reason(overrides, message, tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="titan_exp.launch"):
        code, summary = run_job([*SMALL, *FSDP2_TP2, "cluster.nproc_per_node=2", *overrides], tmp_path)
    assert code == 2 and summary is None and not any(tmp_path.iterdir())
    assert message in caplog.text
    if "fits in memory" in message:
        assert "GiB per device (" in caplog.text and "each device has 0.01 GiB" in caplog.text


def test_min_nodes_rules():
    from conftest import job_config

    from titan_exp.cluster.slurm.submit import sbatch_parameters
    from titan_exp.validation import validate

    slurm = ["cluster=slurm", "cluster.nnodes=3", "cluster.nproc_per_node=2", "checkpoint=default", "parallelism=fsdp",
             "training.global_batch_size=12", "training.local_batch_size=2"]
    job = job_config([*SMALL, *slurm, "cluster.min_nodes=2", "cluster.elastic=true"])
    params = sbatch_parameters(job.cluster)
    assert params["additional_parameters"] == {"nodes": "2-3", "mincpus": 2} and "ntasks_per_node" not in params
    assert params["srun_args"] == ["--kill-on-bad-exit=1", "--ntasks-per-node=2"] and not validate(job)
    assert any("cluster.min_nodes = 2: a job on fewer nodes needs a layout for them; set cluster.elastic=true" in e
               for e in validate(job_config([*SMALL, *slurm, "cluster.min_nodes=2"])))
    assert any("cluster.min_nodes = 4: must be 1..cluster.nnodes = 3" in e
               for e in validate(job_config([*SMALL, *slurm, "cluster.min_nodes=4", "cluster.elastic=true"])))


def test_a_hardware_file_is_what_the_run_is_re_planned_for(tmp_path, caplog):
    """With cluster.hardware the re-plan predicts on the file's GPUs and fits the layout in their
    memory (this machine's would hold this model many times over); a file it cannot read is
    refused naming the field."""
    from conftest import job_config

    from titan_exp.cluster.elastic import replanned
    from titan_exp.record import RunDir

    def gpu(memory_gib: float) -> str:
        path = tmp_path / f"gpu_{memory_gib}.yaml"
        path.write_text(f"device: {{bf16_tflops: 400, tf32_tflops: 200, memory_gib: {memory_gib}, memory_tb_s: 2}}\n"
                        "nvlink_gb_s: 200\nnetwork_gb_s: 25\n")
        return f"cluster.hardware={path}"

    base = [*SMALL, *FSDP2_TP2, "cluster=slurm", "cluster.gpus_per_node=2", "cluster.nproc_per_node=2",
            "checkpoint=default", "cluster.elastic=true"]
    run_dir = RunDir(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="titan_exp.launch"):
        new, errors = replanned(job_config([*base, gpu(48)]), run_dir, "cluster.nproc_per_node")
    assert errors == [] and new.parallelism.layout != job_config(base).parallelism.layout
    line = replanned_to(caplog, 2)
    assert "GiB per device); hardware from " in line and "of 48.00 GiB per device" in line
    # multi-head latent attention re-plans on the file's GPUs too
    mla, errors = replanned(job_config([*base, gpu(48), "model=deepseek_v3_debug"]), run_dir, "cluster.nproc_per_node")
    assert errors == [] and mla.model.mla and mla.parallelism.layout != job_config(base).parallelism.layout
    _, errors = replanned(job_config([*base, gpu(0.001)]), run_dir, "cluster.nproc_per_node")
    assert errors and "no layout of 2 ranks fits in memory" in errors[0] and "each device has 0.00 GiB" in errors[0]
    _, errors = replanned(job_config([*base, f"cluster.hardware={tmp_path / 'none.yaml'}"]), run_dir,
                          "cluster.nproc_per_node")
    assert errors == [f"cluster.hardware = '{tmp_path / 'none.yaml'}': no such file; give the path of a hardware "
                      "YAML (keys: device, gpus_per_node, nvlink_gb_s, network_gb_s, nvlink_bus_gb_s, "
                      "network_bus_gb_s, latency_nvlink_us, latency_network_us, power_limit_w, host_cpu), or null to "
                      "predict from this machine's profile"]


# --- SLURM: a 3-node job loses a node and goes on on 2 ----------------------------------------------

from slurm_jobs import hosts_by_rank, job_info, job_nodes, submit, wait_until  # noqa: E402


def sacct_state(run_dir: Path) -> str:
    """The job's state as sacct says it now. (submitit's watcher, which titan_exp's follow reads,
    stops asking about a job once it saw a final state, and a node failure's NODE_FAIL is one,
    though SLURM then requeues the job.)"""
    import subprocess

    out = subprocess.run(["sacct", "-n", "-X", "-j", job_info(run_dir)["job_id"], "-o", "State"],
                         capture_output=True, text=True)
    return out.stdout.strip().split("\n")[-1].strip()


@pytest.mark.slow  # about 2 minutes on 2 cores, half of it the one-process run it is compared with
@pytest.mark.slurm
@pytest.mark.multinode
def test_job_that_loses_a_node_continues_on_the_others(nodes, tmp_path):
    """A 3-node FSDP job (cluster.min_nodes=2) loses a node: its slurmd and every process on it
    are killed and the node is marked DOWN, as a health check would. SLURM requeues the job; the
    only 2 nodes left run it, the job's batch script re-plans the layout for their 4 ranks, and
    the run resumes from its last periodic checkpoint to the losses of an uninterrupted
    one-process run."""
    import subprocess

    from conftest import REPO, logged_steps, losses_by_step

    args = [*SMALL, "training.steps=12", "training.global_batch_size=12", "training.local_batch_size=2",
            "checkpoint=default", "checkpoint.interval=2", "cluster.elastic=true"]
    code, local = run_job([*args, "cluster=debug"], tmp_path / "local")
    assert code == 0, local
    run_dir = tmp_path / "slurm"
    out = submit([*args, "parallelism=fsdp", "cluster.partition=nodes", "cluster.nnodes=3", "cluster.min_nodes=2",
                  "cluster.nproc_per_node=2"], run_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    script = next((run_dir / "slurm").glob("*_submission.sh")).read_text()
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "#SBATCH --nodes=2-3" in script and "#SBATCH --ntasks-per-node" not in script
    assert " --ntasks-per-node=2 " in srun
    wait_until(lambda: logged_steps(run_dir) >= 3, 240, "three steps")
    first = job_nodes(run_dir)
    assert len(first) == 3, first
    victim = first[-1]
    try:
        for pid in subprocess.run(["ip", "netns", "pids", victim], capture_output=True, text=True,
                                  check=True).stdout.split():
            subprocess.run(["kill", "-9", pid], check=False)  # slurmd, the job step, the ranks: the node is gone
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=DOWN", "Reason=titan_exp test: node lost"],
                       check=True)
        wait_until(lambda: sacct_state(run_dir).startswith("PENDING"), 120, "the requeued job")
        subprocess.run(["scontrol", "update", f"JobId={job_info(run_dir)['job_id']}", "StartTime=now"], check=True)
        wait_until(lambda: sacct_state(run_dir).startswith("COMPLETED"), 400, "the job on 2 nodes")
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "local_slurm.sh"), "revive", victim], check=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok", summary
    spans = summary["layouts"]
    assert [s["world"] for s in spans] == [6, 4] and spans[0]["layout"]["dp_shard"] == 6, spans
    assert spans[1]["from_step"] == summary["start_step"] - 1 >= 2 and spans[1]["layout"] == summary["layout"]
    second = {host for rank, host in hosts_by_rank(run_dir, -1).items() if rank < 4}  # 4, 5: the first start's
    assert len(second) == 2 and victim not in second
    assert losses_by_step(run_dir) == pytest.approx(local["losses"], abs=1e-5)
