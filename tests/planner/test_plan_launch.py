"""A plan a user can run as printed: it plans what the model is trained with (the preset's settings,
or it refuses to guess), says so in short header lines, marks ties within its quoted error, and
gives every top row the overrides that launch it; a written sweep runs as the plan prints it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, job_config

from titan_exp.config import compose_job, layout_label
from titan_exp.perf.rates.accuracy import published
from titan_exp.validation import validate


def plan(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.quick
def test_llama3_presets_carry_the_settings_they_are_trained_with():
    """TorchTitan's Llama 3 train configs: bf16 at seq 8192; local batch 1 (8B, and the 1B/3B it has no
    config for), 8 (70B), 2 (405B); selective AC for the 8B, full for 70B and 405B. The command line
    still wins; the debug model keeps its small defaults."""
    expected = {"llama3_1b": (1, "none"), "llama3_3b": (1, "none"), "llama3_8b": (1, "selective"),
                "llama3_70b": (8, "full"), "llama3_405b": (2, "full")}
    for name, (local, ac) in expected.items():
        job = job_config([f"model={name}"])
        assert (job.precision.name, job.training.seq_len, job.training.local_batch_size,
                job.activation_checkpoint.mode.value, job.model.flavor) == ("bf16", 8192, local, ac, name)
    mine = job_config(["model=llama3_8b", "precision=fp32", "training.seq_len=2048"])
    assert (mine.precision.name, mine.training.seq_len) == ("fp32", 2048)
    debug = job_config([])
    assert (debug.precision.name, debug.training.seq_len, debug.training.local_batch_size) == ("fp32", 128, 8)


def test_the_plan_of_llama3_8b_on_64_h100_is_of_bf16_at_8192_marks_ties_and_prints_launch_lines():
    out = plan("model=llama3_8b", "--device", "H100", "--world", "64", "--top", "5")  # any case
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "plan: llama3_8b (8.0B parameters), bf16, seq 8,192, AC selective, compile off"
    assert lines[1].startswith("global batch: 64 sequences = 524,288 tokens for every layout")
    assert lines[2] == "devices: 64 x h100, 79.65 GiB each, 8 nodes of 8"
    _, _, error = published()["by_device"]["h100"]
    assert lines[4].startswith(f"accuracy: tokens/s off by {error:.0%} at the median")
    assert all(len(line) <= 120 for line in lines[:5])  # the header in short lines
    table = [line.split(" | ") for line in lines if line.startswith("| ") and line[2].isdigit()]
    tokens = [float(row[5].replace(",", "")) for row in table]
    for row, tps in zip(table, tokens):  # a tie is within the quoted error of the fastest, and only that
        assert (row[1] == "tie") == (tps >= tokens[0] * (1 - error)), row
    ties = next(line for line in lines if line.startswith("ties: "))
    assert f"are within the {error:.0%} quoted error of the fastest; of them rank " in ties and "GiB free" in ties
    # Each launch line composes into the planned layout of 64 GPUs on 8 nodes, valid as the launcher checks it.
    launch = [line for line in lines if line.startswith("  rank ")]
    assert len(launch) >= 3 and "cluster=slurm takes your site's defaults" in out.stdout
    for line in launch:
        rank, command = line.strip().split(": ", 1)
        words = shlex.split(command)
        assert words[0].endswith("titan-exp") and "cluster=slurm" in words
        job = compose_job([w for w in words if "=" in w])
        k = int(rank.split()[1])  # the roomiest tie's may rank below the --top rows printed
        assert (job.world_size, job.cluster.nnodes, job.cluster.nproc_per_node) == (64, 8, 8), line
        assert job.training.global_batch_size == 64 and job.precision.name == "bf16", line
        assert k > len(table) or table[k - 1][2] == layout_label(job.parallelism.layout), line
        assert not validate(job, cuda=True), (line, validate(job, cuda=True))


def test_plan_refusals_are_one_line():
    """A model with no training settings is not planned at the debug model's fp32 and seq 128
    unless asked; a bad device or a missing flag is one line, exit 2, no usage dump."""
    guessed = plan("model=mixtral_8x7b", "--device", "h100", "--world", "64")
    assert guessed.returncode == 2 and guessed.stderr.count("\n") == 1, guessed.stderr
    assert "model=mixtral_8x7b does not say what it trains with" in guessed.stderr
    assert "precision=fp32 and training.seq_len=128 are the debug model's" in guessed.stderr
    stated = plan("model=mixtral_8x7b", "precision=bf16", "training.seq_len=4096", "--device", "h100", "--world", "64",
                  "--top", "1")
    assert stated.returncode == 0, stated.stderr[-2000:]
    assert stated.stdout.startswith("plan: mixtral_8x7b (46.7B parameters, 12.9B active), bf16, seq 4,096")
    for args, says in ((["--device", "nope", "--world", "8"], "--device 'nope': no spec sheet for it; choose from"),
                       (["model=llama3_8b"], "the following arguments are required: --world")):
        out = plan(*args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, out.stderr


def test_a_written_sweep_runs_as_printed(tmp_path, monkeypatch):
    """On this machine: the printed command (the installed entry point, this machine's 2 ranks) runs
    every member; for 16 H100s over 2 nodes, each member composes into a valid 16-rank job."""
    out = plan("model=debugmodel", "training.steps=2", "autotune.calibrate=false", "--world", "2", "--top", "2",
               "--write-sweep", "mine", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    command = out.stdout.splitlines()[-1].split("run it (from this folder): ", 1)[1]
    assert command.split()[0].endswith("titan-exp") and " -m +sweep=mine " in command  # the installed entry point
    ran = subprocess.run(shlex.split(command), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in (tmp_path / "multirun").glob("*/*/*/summary.json")]
    assert len(summaries) == 2 and all(s["status"] == "ok" for s in summaries), summaries
    gpus = plan("model=llama3_8b", "--device", "h100", "--world", "16", "--top", "2", "--write-sweep", "h100_8b",
                cwd=tmp_path)
    assert gpus.returncode == 0, gpus.stderr[-2000:]
    command = gpus.stdout.splitlines()[-1].split("run it (from this folder): ", 1)[1]
    assert command.split(" ", 1)[1] == "-m +sweep=h100_8b cluster=slurm model=llama3_8b"
    monkeypatch.setenv("TITAN_EXP_SWEEPS", str(tmp_path / "sweeps"))  # the written members, as launch finds them
    for member in ("h100_8b_0", "h100_8b_1"):
        job = compose_job(["cluster=slurm", "model=llama3_8b", f"+plan_layout={member}"])
        assert (job.world_size, job.cluster.nnodes, job.cluster.nproc_per_node) == (16, 2, 8)
        assert job.training.global_batch_size == 16 and not validate(job, cuda=True), validate(job, cuda=True)
