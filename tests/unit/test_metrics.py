"""Throughput/MFU arithmetic and the warmup-stable-decay schedule."""

from __future__ import annotations

import time

import pytest

from titan_exp.config import LRSchedulerConfig
from titan_exp.metrics import StepHistory, Throughput, measure_cpu_peak_tflops, peak_matrix_size
from titan_exp.train.optim import lr_lambda


def test_throughput_and_mfu():
    tp = Throughput(flops_per_token=1_000_000, peak_tflops=0.1, world_size=2, warmup_steps=1)
    tp.record(tokens=1000, seconds=10.0)  # warm-up: in the window, not in steady state
    tp.record(tokens=4000, seconds=1.0)
    assert tp.window()["tps_per_device"] == pytest.approx(5000 / 11 / 2)
    steady = tp.steady()
    assert steady["tps_per_device"] == pytest.approx(2000)
    assert steady["mfu"] == pytest.approx(100 * 2000 * 1e6 / 1e11)
    short = Throughput(flops_per_token=1, peak_tflops=1, world_size=1, warmup_steps=5)
    short.record(tokens=100, seconds=1.0)  # no step past warm-up: the whole run counts
    assert short.steady()["tps_per_device"] == pytest.approx(100)


def test_steady_throughput_is_the_median_step():
    """One stalled step of five moves the mean to a third and leaves the median where it was."""
    tp = Throughput(flops_per_token=1, peak_tflops=1, world_size=1, warmup_steps=2)
    for seconds in (5.0, 3.0, 1.0, 1.1, 0.9, 9.0, 1.0):  # two warm-up steps, then one stall among five
        tp.record(tokens=100, seconds=seconds)
    steady = tp.steady()
    assert steady["tps_per_device"] == pytest.approx(100)
    assert steady["tps_per_device_mean"] == pytest.approx(500 / 13)
    assert steady["mfu"] == pytest.approx(100 * 100 / 1e12) and steady["mfu_mean"] < steady["mfu"] / 2


def test_a_stalled_step_does_not_move_the_summarys_tokens_per_second(tmp_path, monkeypatch):
    """A real run whose step 5 sleeps for real (TITAN_EXP_FAULT=slow@5): summary.json's tokens/s and
    MFU are the median steady step's (steps 3-8), as the run's own step times give them, so within
    the rates of the steps that did not stall; the mean, which counts the stall, is kept beside.
    (Not `mean < median`: on a loaded CPU the steps' own noise can outweigh the stall.)"""
    import statistics

    from conftest import SMALL, run_job

    from titan_exp.faults import SLOW_S

    monkeypatch.setenv("TITAN_EXP_FAULT", "slow@5")
    code, summary = run_job([*SMALL, "training.steps=8", "metrics.warmup_steps=2"], tmp_path)
    assert code == 0, summary
    tokens, times = 8 * 64, summary["step_times_s"]
    assert len(times) == 8 and times[4] >= SLOW_S
    median, mean = summary["tokens_per_second_per_device"], summary["tokens_per_second_per_device_mean"]
    assert median == pytest.approx(statistics.median(tokens / t for t in times[2:]), rel=1e-3)
    unstalled = [tokens / t for t in times[2:4] + times[5:]]
    assert min(unstalled) <= median <= max(unstalled)
    assert mean == pytest.approx(6 * tokens / sum(times[2:]), rel=1e-3)
    assert summary["mfu"] / summary["mfu_mean"] == pytest.approx(median / mean)


@pytest.mark.quick
def test_step_history_reads_each_step_once_in_order():
    import time

    import torch

    history = StepHistory(torch.device("cpu"))
    for step, (loss, norm) in enumerate([(2.0, 0.5), (float("nan"), 1.5), (1.0, 0.25)], start=1):
        history.start()
        time.sleep(0.01 * step)
        history.add(step, torch.tensor(loss), torch.tensor(norm, dtype=torch.float64))
        if step == 2:
            assert history.unread
            first = history.read()
    rest = history.read()
    assert not history.unread and history.read() == []
    assert [r[0] for r in first] == [1, 2] and [r[0] for r in rest] == [3]
    assert first[0][1:3] == (2.0, 0.5) and first[1][1] != first[1][1] and rest[0][1:3] == (1.0, 0.25)
    seconds = [r[3] for r in first + rest]
    assert seconds == sorted(seconds) and seconds[0] >= 0.01  # each step its own time, not a window's mean
    assert history.losses[2] == 1.0 and history.grad_norms == [0.5, 1.5, 0.25] and history.step_times == seconds


def test_cpu_peak_is_measured_and_the_best_is_kept(monkeypatch, tmp_path):
    import torch

    from titan_exp import metrics

    monkeypatch.setenv("TITAN_EXP_CACHE", str(tmp_path))  # not the session's cache

    assert 0.001 < measure_cpu_peak_tflops(torch.float32, n=256, reps=2) < 100
    # Where a dtype runs near 1 GFLOP/s (bf16 without AVX512-BF16 or AMX) six 2048² products would
    # take 100 s at every job's start; the size shrinks to fit 3 s, and stays 2048 where it is fast.
    assert peak_matrix_size(1e9, budget_s=3.0, reps=5) == 576 and peak_matrix_size(2e11, 3.0, 5) == 2048
    assert peak_matrix_size(1e6, 3.0, 5) == 256
    # The best of the first PEAK_SAMPLES (3) is kept; later launches measure nothing, until a day
    # has passed since the last measurement.
    for measured, kept in ((0.5, 0.5), (0.2, 0.5), (0.7, 0.7), (0.9, 0.7), (0.9, 0.7)):
        monkeypatch.setattr(metrics, "measure_cpu_peak_tflops", lambda dtype, m=measured: m)
        assert metrics.best_cpu_peak_tflops(torch.float32) == kept
    now = time.time()
    monkeypatch.setattr(metrics.time, "time", lambda: now + metrics.PEAK_REFRESH_S + 1)
    assert metrics.best_cpu_peak_tflops(torch.float32) == 0.9


def test_warmup_stable_decay():
    f = lr_lambda(LRSchedulerConfig(warmup_steps=2, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.1), 10)
    factors = [f(i) for i in range(10)]  # optimizer steps 1..10
    assert factors[:2] == [0.5, 1.0]
    assert factors[2:5] == [1.0, 1.0, 1.0]  # stable until step 5, then 5 decay steps
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[1:], factors[2:]))
    cosine = lr_lambda(LRSchedulerConfig(warmup_steps=0, decay_type="cosine"), 4)
    assert [round(cosine(i), 4) for i in range(4)] == [0.8536, 0.5, 0.1464, 0.0]


def wandb_run_record(run_dir):
    """The run record (project, group, name, tags) of the offline wandb run in a run dir, read
    from wandb's own .wandb file: a LevelDB-style log of protobuf records after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, block, partial = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (2, 3):  # first / middle part of a record
            partial += chunk
            continue
        if kind in (1, 4):  # a whole record / its last part
            record = pb.Record()
            record.ParseFromString(partial + chunk)
            partial = b""
            if record.WhichOneof("record_type") == "run":
                return record.run
    raise AssertionError(f"no run record in {path}")


def test_wandb_follows_its_conventions(tmp_path, monkeypatch):
    """Sweep members share a group named after the sweep and are named by their overrides; unset
    fields are left to WANDB_* variables; tags pass through; disabled writes nothing."""
    import json

    from conftest import SMALL, launch_cli

    monkeypatch.setenv("WANDB_PROJECT", "from-the-env")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sweep = tmp_path / "sweep"
    out = launch_cli(["-m", *SMALL, "training.steps=2", "cluster=debug", "metrics.enable_wandb=true",
                      "metrics.wandb_tags=[ablation,lr]", "optimizer.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}"])
    assert out.returncode == 0, out.stderr[-2000:]
    runs = [wandb_run_record(sweep / n) for n in ("0", "1")]
    for run, lr in zip(runs, ("optimizer.lr=0.001", "optimizer.lr=0.002")):  # override_dirname: key=value,...
        assert lr in run.display_name.split(",") and "cluster=debug" in run.display_name.split(",")
    for run in runs:
        assert run.run_group == str(sweep).strip("/") and run.project == "from-the-env"
        assert list(run.tags) == ["ablation", "lr"]
    single = tmp_path / "single"
    out = launch_cli([*SMALL, "training.steps=2", "cluster=debug", "metrics.enable_wandb=true",
                      "metrics.wandb_mode=disabled", f"hydra.run.dir={single}"])
    assert out.returncode == 0 and not (single / "wandb").exists()
    assert json.loads((single / "summary.json").read_text())["status"] == "ok"
