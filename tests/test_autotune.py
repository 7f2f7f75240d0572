"""Autotune as a user runs it (issue 41): what the profile lacks is calibrated first (or the
predictions say they are FLOPs estimates), every layout runs at a batch split that makes it valid,
and the first round measures the candidates whose predicted interval reaches the best one's."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from conftest import REPO, SMALL, job_config, launch_cli
from test_perf import TINY, synthetic
from titan_exp.perf.autotune import Autotune, candidates
from titan_exp.perf.fit import Check
from titan_exp.perf.profile import this_machine
from titan_exp.validation import validate


def test_a_layout_runs_at_a_split_that_makes_it_valid():
    """A global batch of 4 with a local batch of 1 leaves pp4 one microbatch for four stages: the
    search runs it at local batch 4 and microbatch 1 instead, the same global batch. Every split
    that validates is a candidate, and every candidate's overrides give a job the validator
    accepts; naming a split axis in the search is refused, saying why."""
    job = job_config([*SMALL, *TINY, "training.global_batch_size=4", "training.local_batch_size=1",
                      "cluster.nproc_per_node=4"])
    grid = candidates(job, 4, cuda=False, profile=synthetic(job, 4), memory_gib=1e9)
    splits = {}
    for c in grid:
        splits.setdefault(c.layout, set()).add(c.split)
    assert splits["pp4"] == {"local batch 4, microbatch 1"}
    assert splits["dp_shard4"] == {"local batch 1"}
    assert splits["dp_shard2 x tp2"] == {"local batch 1 x 2 accumulated", "local batch 2"}
    for c in grid:
        composed = job_config([*SMALL, *TINY, *c.overrides])
        assert not validate(composed, cuda=False), c.name
        assert composed.training.global_batch_size == 4
    (error,) = validate(job_config([*SMALL, "autotune.search=[layout,microbatch_size]"]), cuda=False)
    assert error.startswith("autotune.search = ['layout', 'microbatch_size']: microbatch_size: every split")


def test_the_first_round_is_every_candidate_whose_interval_reaches_the_best(tmp_path):
    """With predictions known to within 2 %, only the candidates predicted near the best are
    measured; with predictions that were once off by 500 % every candidate may be the fastest;
    top_k caps either."""
    job = job_config([*SMALL, *TINY, "training.global_batch_size=8", "cluster.nproc_per_node=4"])
    profile = synthetic(job, 4)
    tune = Autotune(job, [], launch=lambda batch: [], sweep_dir=tmp_path, cuda=False, profile=profile)
    fitting = candidates(job, 4, cuda=False, profile=profile, memory_gib=1e9)
    best = fitting[0].predicted_tps
    sharp = tune._contenders(fitting, Check(0.02, "then", "here"), budget_s=1e9)
    assert sharp and all(c.predicted_tps * 1.05 >= best / 1.05 for c in sharp)
    assert len(sharp) < len(fitting) and "does not reach the best one's" in fitting[-1].pruned
    assert tune._contenders(fitting, Check(5.0, "then", "here"), budget_s=1e9) == fitting
    capped = Autotune(dataclasses.replace(job, autotune=dataclasses.replace(job.autotune, top_k=2)), [],
                      launch=lambda batch: [], sweep_dir=tmp_path, cuda=False, profile=profile)
    assert capped._contenders(fitting, Check(5.0, "then", "here"), budget_s=1e9) == fitting[:2]
    assert "(top_k)" in fitting[2].pruned


def test_uncalibrated_predictions_say_so_first(tmp_path):
    """autotune.calibrate=false: the plan's first line says which parts are FLOPs estimates and how
    far off such estimates were when last checked; nothing is started."""
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *TINY, "autotune.calibrate=false", "--world",
                          "2", "--profile-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("PREDICTIONS ARE FLOPs ESTIMATES for this machine at world 2 (no profile)")
    assert "when last checked (2026-11-24" in first and not (tmp_path / "runs").exists()


def test_the_sweep_calibrates_what_the_profile_lacks_and_counts_it(tmp_path, monkeypatch):
    """A real autotune sweep on 2 ranks with no profile: it calibrates this machine for the model
    first, through the executor, counts that time in the machine time it reports, predicts from the
    new profile, and its record says the split every candidate ran with."""
    monkeypatch.setenv("TITAN_EXP_CACHE", str(tmp_path / "cache"))  # nothing calibrated before
    sweep = tmp_path / "sweep"
    overrides = [*SMALL, *TINY, "model.n_layers=2", "training.global_batch_size=4", "cluster.nproc_per_node=2"]
    result = launch_cli(["-m", "+sweep=autotune", *overrides, f"hydra.sweep.dir={sweep}", "autotune.top_k=2",
                         "autotune.steps=2", "autotune.warmup_steps=1", "autotune.refit=false",
                         "autotune.budget_minutes=1"], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((sweep / "autotune.json").read_text())
    cal = record["calibration"]
    assert cal["measured"] == ["this machine at world 2 (no profile)"] and cal["estimated"] == []
    assert 0 < cal["seconds"] <= record["spent_s"]
    assert record["profile"] != "defaults" and (sweep / "calibration" / "summary.json").is_file()
    profile = this_machine(2, folder=tmp_path / "cache" / "perf")
    assert profile.source == "calibrated" and not profile.missing(job_config(overrides), [1, 2], compile=False)
    assert all(c["split"].startswith("local batch ") for c in record["candidates"])
    assert "| batch split |" in (sweep / "autotune.md").read_text()
