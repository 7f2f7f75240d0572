"""A training run planned, not a step (`python -m titan_exp.perf.plan --tokens N`,
titan_exp.perf.search.run): the token counts it reads and refuses, the GPU counts it takes, the
arithmetic of its table (days, GPU-hours, cost, the error band, the deadline and cheapest marks),
the bounded search it runs at each count against the full one, and the command end to end."""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, job_config

from titan_exp.config import Executor, compose_job, layout_label
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.accuracy import published
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.search import planner, run
from titan_exp.validation import validate


def plan(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def on_h100s(job, world: int, per_node: int = 8):
    """`job` on `world` H100s of the spec sheet, as the plan's --device h100 sets it up."""
    per_node = min(per_node, world)
    cluster = dataclasses.replace(job.cluster, executor=Executor.slurm, nnodes=world // per_node,
                                  nproc_per_node=per_node, gpus_per_node=per_node)
    return dataclasses.replace(job, cluster=cluster), spec_profile(SPECS["h100"], world, per_node), 79.65


@pytest.mark.quick
def test_token_counts_are_read_as_written_and_others_refused():
    assert [run.parse_tokens(t) for t in ("15T", "500B", "2.5t", "1e12", "15_000_000", "7k", "3M")] == [
        15 * 10**12, 500 * 10**9, 2_500_000_000_000, 10**12, 15_000_000, 7000, 3_000_000]
    for bad in ("15X", "T", "-1T", "0", "nan", "inf", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a token count: write it as 15T"):
            run.parse_tokens(bad)
    assert [run.parse_batches(b) for b in ("1024", "512-2048")] == [(1024, 1024), (512, 2048)]
    for bad in ("2048-512", "0", "x", "512-"):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a global batch in sequences"):
            run.parse_batches(bad)
    job = job_config(["training.global_batch_size=512"])
    assert run.batch_choices(job, None) == [512]
    assert run.batch_choices(job, (512, 2048)) == [512, 1024, 2048]
    assert run.batch_choices(job, (512, 1500)) == [512, 1024]  # doubling, up to HI


@pytest.mark.quick
def test_gpu_counts_are_whole_nodes_doubling_up_to_the_maximum():
    assert run.gpu_counts(8, 1024) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert run.gpu_counts(8, 1000) == [8, 16, 32, 64, 128, 256, 512]  # a whole number of nodes, doubling
    assert run.gpu_counts(4, 64, 16) == [16, 32, 64]
    assert run.gpu_counts(72, 300) == [72, 144, 288]  # an NVL72 rack's nodes
    with pytest.raises(ValueError, match="--max-gpus 4: fewer than 8"):
        run.gpu_counts(8, 4)
    with pytest.raises(ValueError, match="--min-gpus 24: not a count the plan takes"):
        run.gpu_counts(8, 64, 24)


def test_the_bounded_search_at_a_count_finds_what_the_full_search_finds():
    """fastest_fitting prices every split and validates, and predicts the memory of, only one faster
    than the fastest that fits so far: its answer is the full search's (every layout at its fastest
    split that fits, then the fastest of those), at any memory limit, and where none fits it says
    which layout needs the least."""
    job = job_config(["model=llama3_100m", "training.seq_len=512", "training.global_batch_size=32"])
    for world, memory in ((8, 79.65), (16, 79.65), (16, 1.3), (8, 0.05)):
        on, profile, _ = on_h100s(job, world)
        answer = planner.fastest_fitting(on, world, cuda=True, memory_gib=memory, profile=profile)
        layouts = planner.best_split_layouts(on, world, profile, cuda=True, memory_gib=memory)
        fits = [j for j in layouts if predict_memory(j, cuda=True)["total"] <= memory]
        if not fits:
            assert answer.job is None and answer.valid == len(layouts) > 0
            assert answer.least_gib == min(predict_memory(j, cuda=True)["total"] for j in layouts) > memory
            continue
        best = min(fits, key=lambda j: predict_step(j, profile, cuda=True).step_s)
        assert (answer.job.parallelism.layout, answer.job.training.local_batch_size) == (
            best.parallelism.layout, best.training.local_batch_size), world
        assert answer.step_s == predict_step(best, profile, cuda=True).step_s and not validate(answer.job, cuda=True)


@pytest.fixture(scope="module")
def rows():
    """The run of the 100M model at 8, 16 and 32 H100s, searched one count at a time."""
    job = job_config(["model=llama3_100m", "training.seq_len=512", "training.global_batch_size=64"])
    return run.plan_run([8, 16, 32], lambda world: on_h100s(job, world), [64], workers=1)


def test_the_run_tables_arithmetic(rows):
    """days = tokens / (tokens/s per device x GPUs x 86,400); GPU-hours = days x 24 x GPUs; cost =
    GPU-hours x price; the band is the time at tokens/s (1 + error) and (1 - error); the deadline
    mark is on the fewest GPUs whose days meet it, the cheapest on the fewest GPU-hours; and the
    counts searched at once in processes give the rows searched one by one."""
    tokens, error, price = 2 * 10**12, published()["by_device"]["h100"][2], 2.5
    assert [r.gpus for r in rows] == [8, 16, 32] and [r.nodes for r in rows] == [1, 2, 4]
    days = [tokens / (r.plan.tokens_per_s * r.gpus * 86_400) for r in rows]
    for r, d in zip(rows, days):
        assert r.plan.fits and r.global_batch == 64 and r.plan.job.training.global_batch_size == 64
        assert run.days(tokens, r.tokens_per_s) == pytest.approx(d, rel=1e-12)
        assert run.gpu_hours(d, r.gpus) == pytest.approx(d * 24 * r.gpus)
        assert run.band(d, error) == pytest.approx((d / (1 + error), d / (1 - error)))
        assert run.efficiency(r, rows[0]) == pytest.approx(r.plan.tokens_per_s / rows[0].plan.tokens_per_s)
    assert run.band(1.0, None) == (1.0, 1.0) and run.band(1.0, 1.0)[1] == math.inf
    hours = [d * 24 * r.gpus for r, d in zip(rows, days)]
    assert run.cheapest(rows, tokens) is rows[hours.index(min(hours))]
    for deadline in (*days, min(days) * 0.99, max(days) * 2):
        meets = next((r for r, d in zip(rows, days) if d <= deadline), None)
        assert run.fewest_meeting(rows, tokens, deadline) is meets
        q = run.Question(tokens, [8, 16, 32], [64], 8, 32, deadline=deadline)
        row, why = run.picked(rows, q)
        assert row is (meets or max(rows, key=lambda r: r.tokens_per_s)), why
    table = run.table(rows, tokens, error, price, days[1]).splitlines()
    cells = [line.split(" | ") for line in table[2:]]
    cheapest = hours.index(min(hours))
    for i, (row, d, h) in enumerate(zip(cells, days, hours)):
        assert row[5] == f"{run.short(d)} ({run.short(d / (1 + error))}-{run.short(d / (1 - error))})"
        assert row[7].startswith(f"${run.short(h * price)} (")
        marks = row[-1].rstrip(" |")
        assert ("meets deadline" in marks) == (i == next(k for k, x in enumerate(days) if x <= days[1]))
        assert ("cheapest" in marks) == (i == cheapest)
    job = job_config(["model=llama3_100m", "training.seq_len=512", "training.global_batch_size=64"])
    at_once = run.plan_run([8, 16, 32], lambda world: on_h100s(job, world), [64], workers=2)
    assert [(r.plan.name, r.plan.split, r.plan.tokens_per_s) for r in at_once] == [
        (r.plan.name, r.plan.split, r.plan.tokens_per_s) for r in rows]


def test_a_count_that_cannot_keep_the_batch_says_so_and_a_range_takes_the_smallest_that_fits():
    job = job_config(["model=llama3_100m", "training.seq_len=512", "training.global_batch_size=2"])
    on, profile, memory = on_h100s(job, 16)
    kept = run.search(on, 16, profile, memory, [2])
    assert kept.plan is not None and kept.plan.job.training.global_batch_size == 2  # TP and PP carry it
    few = run.search(on, 16, profile, 0.2, [2])
    assert few.plan is None and few.why_not.startswith("none of its ") and "fits at global batch 2" in few.why_not
    ranged = run.search(on, 16, profile, memory, [1, 2, 4])
    assert ranged.global_batch == 1 and ranged.plan.job.training.global_batch_size == 1


def test_plan_a_run_end_to_end(tmp_path):
    """The command on a small model from the spec sheet: its header, one row per count, the marks,
    the plot, and a launch line that composes into the planned job with the steps that train the
    tokens."""
    out = plan("model=debugmodel", "training.global_batch_size=16", "--tokens", "1B", "--device", "h100",
               "--max-gpus", "32", "--days", "0.5", "--gpu-hour-price", "2", "--out", str(tmp_path / "run.png"),
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("plan: debugmodel")
    assert lines[1] == ("run: 1B tokens, global batch 16 sequences (2,048 tokens) at every count, from "
                        "training.global_batch_size")
    assert lines[2].startswith("GPUs: 8, 16, 32 of h100 (79.65 GiB): whole nodes of 8, doubling")
    _, _, error = published()["by_device"]["h100"]
    assert lines[4].startswith(f"accuracy: tokens/s off by {error:.0%} at the median on ")
    assert all(len(line) <= 120 for line in lines[:5])
    table = [line.split(" | ") for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [row[0] for row in table] == ["| 8", "| 16", "| 32"]
    assert sum("meets deadline" in row[-1] for row in table) == 1 and sum("cheapest" in row[-1] for row in table) == 1
    assert (tmp_path / "run.png").stat().st_size > 10_000
    assert f"plot: {tmp_path / 'run.png'}" in lines
    picked = next(line for line in lines if line.startswith("picked: "))
    gpus = int(picked.split()[1])
    launch = next(line for line in lines if line.startswith("  rank 1: "))
    job = compose_job([w for w in shlex.split(launch.split(": ", 1)[1]) if "=" in w])
    assert job.world_size == gpus and job.training.global_batch_size == 16
    assert job.training.steps == math.ceil(10**9 / (16 * 128))
    row = next(row for row in table if row[0] == f"| {gpus}")
    assert row[2] == layout_label(job.parallelism.layout) and not validate(job, cuda=True)


def test_run_refusals_are_one_line():
    for args, says in (
        (["--tokens", "15X", "--device", "h100"], "argument --tokens: '15X' is not a token count"),
        (["--days", "30", "--world", "8"], "--days describes a run: add --tokens N"),
        (["--tokens", "1B", "--world", "8", "--device", "h100"], "--world plans one step"),
        (["--tokens", "1B"], "--tokens plans a run on a cluster: name its GPUs with --device"),
        (["--tokens", "1B", "--device", "h100"], "training.global_batch_size is -1"),
        (["--tokens", "1B", "--device", "h100", "training.global_batch_size=16", "--global-batch", "8-32"],
         "--global-batch and training.global_batch_size=16 both set the global batch"),
        (["--tokens", "1B", "--device", "h100", "training.global_batch_size=16", "--days", "-1"],
         "--days -1.0: must be a positive number"),
        (["--tokens", "1B", "--device", "h100", "training.global_batch_size=16", "--pick", "24"],
         "--pick 24: not a count of this plan; pick one of 8, 16, 32"),
    ):
        out = plan("model=debugmodel", *args, *(["--max-gpus", "32"] if "--tokens" in args else []))
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, (args, out.stderr)
