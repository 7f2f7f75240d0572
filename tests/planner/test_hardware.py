"""cluster.hardware=FILE (issue 36): the GPUs a job's ranks run on, in the hardware file that
`python -m titan_exp.perf.plan --hardware` reads. A file the job cannot use is refused before
anything of the run is written or started, naming the field, the value and the fix; a job that
can logs its predicted step and memory on those GPUs; the plan takes the field from its overrides.
(Autotune's, the dry run's and cluster.elastic's use of it are tested with each of them.)"""

from __future__ import annotations

import logging

import pytest
from conftest import SMALL, job_config, run_job

from titan_exp.record import RunDir

pytestmark = pytest.mark.quick

WORLD_64_DRY = ["model.n_layers=2", "cluster.nnodes=8", "cluster.nproc_per_node=8", "parallelism=fsdp",
                "training.global_batch_size=64", "training.local_batch_size=1", "cluster.dry_run=true"]
OWN_GPU = ("device: {bf16_tflops: 400, tf32_tflops: 200, memory_gib: 48, memory_tb_s: 2}\nnvlink_gb_s: 200\n"
           "network_gb_s: 25\n")


@pytest.mark.parametrize("text, overrides, message", [
    (None, WORLD_64_DRY, "no such file; give the path of a hardware YAML (keys: device, gpus_per_node, "),
    ("device: h300\n", WORLD_64_DRY, "hw.yaml: device = 'h300': no spec sheet for it; choose from h100, "),
    ("device: [h100\n", WORLD_64_DRY, "hw.yaml: cannot read it as YAML ("),
    ("device: h100\ngpus_per_node: 4\n", WORLD_64_DRY,
     "its nodes hold gpus_per_node 4 GPUs, and the job puts 8 ranks on each of its 8 node(s), one per GPU; "
     "set cluster.nnodes=16 cluster.nproc_per_node=4"),
    ("device: h100\n", ["cluster=slurm", "cluster.gpus_per_node=0"],
     "the file describes GPUs, and this job's ranks run on CPUs (cluster.gpus_per_node = 0); run it where the "
     "file's GPUs are, or dry-run it (cluster.dry_run=true), or remove cluster.hardware"),
])
def test_a_file_the_job_cannot_use_is_refused_before_anything_starts(text, overrides, message, tmp_path, caplog):
    path = tmp_path / "hw.yaml"
    if text is not None:
        path.write_text(text)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.ERROR, logger="titan_exp.launch"):
        code, summary = run_job([*SMALL, *overrides, f"cluster.hardware={path}"], run_dir)
    assert code == 2 and summary is None and not run_dir.exists()
    assert f"cluster.hardware = '{path}': " in caplog.text and message in caplog.text


def test_the_launch_logs_the_predicted_step_on_the_files_gpus(tmp_path, caplog):
    """A job whose ranks have GPUs (8 per SLURM node here) logs, before they start, which values
    came from the file and its predicted step and memory against the file's GPU's 48 GiB."""
    from titan_exp.launch.preflight import hardware, preflight  # here: test_architecture's import-linter run
    # disables the loggers that exist when it runs, and caplog would then see nothing of this one
    path = tmp_path / "hw.yaml"
    path.write_text(OWN_GPU)
    job = job_config([*SMALL, "cluster=slurm", "cluster.gpus_per_node=8", "cluster.nproc_per_node=8",
                      f"cluster.hardware={path}"])
    with caplog.at_level(logging.INFO, logger="titan_exp.launch"):
        _, errors = preflight(job, RunDir(tmp_path / "run"), steps=(hardware,))
    assert errors == []
    assert f"hardware from {path}: device {{'bf16_tflops': 400" in caplog.text
    assert ("predicted on custom (cluster.hardware): " in caplog.text
            and "GiB per device of its 48.00 GiB (fits)" in caplog.text)


def test_the_plan_reads_cluster_hardware_from_its_overrides(tmp_path, capsys):
    """`plan ... cluster.hardware=FILE` is `plan ... --hardware FILE`; both at once are refused,
    and so is a file it cannot use, naming the field."""
    from titan_exp.perf.plan import main

    path = tmp_path / "hw.yaml"
    path.write_text("device: h100\ngpus_per_node: 4\nnvlink_gb_s: 100\n")
    assert main(["model=llama3_8b", f"cluster.hardware={path}", "--world", "16", "--top", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"hardware from {path}: device h100, gpus_per_node 4")
    for argv, message in [
        ([f"cluster.hardware={path}", "--hardware", str(path)], "both name the hardware file; keep one"),
        ([f"cluster.hardware={path}", "--device", "h100"], "cluster.hardware describes the device and GPUs per node"),
        ([f"cluster.hardware={tmp_path / 'none.yaml'}"],
         f"cluster.hardware = '{tmp_path / 'none.yaml'}': no such file"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main(["model=llama3_8b", *argv, "--world", "16"])
        assert exit.value.code == 2 and message in capsys.readouterr().err
