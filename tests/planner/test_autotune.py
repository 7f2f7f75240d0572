"""Autotune as a user runs it (issue 41): what the profile lacks is calibrated first (or the
predictions say they are FLOPs estimates), every layout runs at a batch split that makes it valid,
and the first round measures the candidates whose predicted interval reaches the best one's."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from conftest import REPO, SMALL, job_config, launch_cli
from test_perf import TINY, synthetic

from titan_exp.perf.autotune import Autotune, candidates
from titan_exp.perf.rates.accuracy import Check
from titan_exp.perf.rates.profile import this_machine
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
    # Over 2 nodes each candidate runs as many ranks per node as the base job: its world / 2.
    two_nodes = job_config([*SMALL, *TINY, "training.global_batch_size=8", "cluster.nnodes=2",
                            "cluster.nproc_per_node=2"])
    per_node = {o for c in candidates(two_nodes, 4, cuda=False, profile=profile, memory_gib=1e9)
                for o in c.overrides if o.startswith("cluster.nproc_per_node")}
    assert per_node == {"cluster.nproc_per_node=2"}


def test_uncalibrated_predictions_say_so_first(tmp_path):
    """autotune.calibrate=false: the plan's header says which parts are FLOPs estimates and how
    far off such estimates were when last checked; nothing is started."""
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *TINY, "autotune.calibrate=false", "--world",
                          "2", "--profile-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rates, accuracy = out.stdout.splitlines()[3:5]
    assert rates == ("rates: FLOPs estimates, nothing measured (autotune.calibrate=false), for this machine at world 2 "
                     "(no profile)")
    assert accuracy.startswith("accuracy: tokens/s off by ") and "when last checked: " in accuracy
    assert "2026-11-24" in accuracy and not (tmp_path / "runs").exists()


def test_the_sweep_calibrates_what_the_profile_lacks_and_counts_it(tmp_path, monkeypatch):
    """A real autotune sweep on 2 ranks with no profile: it calibrates this machine for the model
    first, through the executor, counts that time in the machine time it reports, predicts from the
    new profile, and its record says the split every candidate ran with; it prints no warning
    (calibration imports torchao: precision.torchao_imports)."""
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
    assert "warn" not in (result.stdout + result.stderr).lower(), result.stderr[-3000:]


def test_a_hardware_file_is_what_the_candidates_are_predicted_for(tmp_path):
    """cluster.hardware: autotune predicts every candidate on the file's GPUs (a GPU twice as fast
    makes every candidate faster), prunes by the file's GPU memory unless
    autotune.device_memory_gib is set, calibrates nothing, and its record says which values came
    from the file; a file it cannot use is refused before anything is measured."""
    from titan_exp.perf.autotune import markdown

    def gpu(name: str, tflops: float, memory_gib: float) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"device: {{bf16_tflops: {2 * tflops}, tf32_tflops: {tflops}, memory_gib: {memory_gib}, "
                        "memory_tb_s: 2}\nnvlink_gb_s: 100\nnetwork_gb_s: 25\n")
        return f"cluster.hardware={path}"

    base = [*SMALL, *TINY, "training.global_batch_size=8", "cluster=slurm", "cluster.gpus_per_node=4",
            "cluster.nproc_per_node=4"]
    # A GPU memory between the candidates' smallest and largest predicted peak: the file's decides.
    probe = Autotune(job_config([*base, gpu("probe", 50.0, 100)]), [], launch=lambda batch: [], sweep_dir=tmp_path)
    peaks = [c.memory_gib for c in candidates(probe.job, 4, cuda=True, profile=probe.profile, memory_gib=100)]
    cap = round((min(peaks) + max(peaks)) / 2, 4)
    tunes = {name: Autotune(job_config([*base, gpu(name, tflops, cap)]), [], launch=lambda batch: [],
                            sweep_dir=tmp_path)
             for name, tflops in (("slow", 50.0), ("fast", 100.0))}
    slow = tunes["slow"]
    assert slow.profile.source == "spec" and slow.memory_gib == cap and slow.cuda
    assert slow.coverage.profile.missing(slow.job, [1, 2, 4], compile=False) == []  # nothing to calibrate
    grids = {name: {c.name: c for c in candidates(t.job, 4, cuda=t.cuda, profile=t.profile, memory_gib=t.memory_gib)}
             for name, t in tunes.items()}
    assert grids["slow"].keys() == grids["fast"].keys()
    for name, c in grids["slow"].items():
        assert grids["fast"][name].predicted_step_s < c.predicted_step_s
        assert c.fits == (c.memory_gib <= cap)
    assert {c.fits for c in grids["slow"].values()} == {True, False}  # the file's memory decides
    record = slow._record(list(grids["slow"].values()), None, "not measured", 60.0, Check(0.1, "then", "here"))
    assert record["hardware"] == slow.hardware.line() and slow.hardware.line() in markdown(record)
    assert " Global batch: 8 sequences = " in markdown(record)
    assert " tokens for every layout, from training.global_batch_size. " in markdown(record)
    roomy = Autotune(job_config([*base, gpu("slow", 50.0, 0.03), "autotune.device_memory_gib=5"]), [],
                     launch=lambda batch: [], sweep_dir=tmp_path)
    assert roomy.memory_gib == 5
    for overrides, message in [
        ([*base, f"cluster.hardware={tmp_path / 'none.yaml'}"], "no such file"),
        ([*base, gpu("slow", 50.0, 0.03), "cluster.gpus_per_node=0", "cluster.nproc_per_node=4"],
         "this job's ranks run on CPUs"),
    ]:
        with pytest.raises(ValueError, match=rf"^autotune: cluster\.hardware = '.*': .*{message}"):
            Autotune(job_config(overrides), [], launch=lambda batch: [], sweep_dir=tmp_path)


@pytest.mark.quick
def test_the_precision_axis_is_what_the_device_trains_fastest_with():
    """autotune.search=[precision]: on a GPU bf16 and float8 tensorwise and rowwise (issue 38's
    axes; fp32 is never the fastest there), on a CPU fp32 and bf16 (float8 is emulated); each at
    every split of the global batch."""
    from titan_exp.perf.rates.devices import SPECS, spec_profile

    job = job_config([*SMALL, *TINY, "training.global_batch_size=4", "training.local_batch_size=4",
                      "autotune.search=[precision]", "cluster=slurm",
                      "cluster.gpus_per_node=1"])  # a GPU node, whatever this machine has
    gpu = candidates(job, 1, cuda=True, profile=spec_profile(SPECS["h200"], 1, 1), memory_gib=1e3)
    cpu = candidates(job, 1, cuda=False, profile=this_machine(1), memory_gib=1e3)
    assert {(c.layout.split(", ")[-1], c.split) for c in gpu} == {
        (p, f"local batch {b}" + (f" x {4 // b} accumulated" if b < 4 else ""))
        for p in ("bf16", "float8", "float8_rowwise") for b in (1, 2, 4)}
    assert {c.layout.split(", ")[-1] for c in cpu} == {"fp32", "bf16"}


@pytest.mark.quick
@pytest.mark.parametrize("search", ["[precision,float8_filter]", "[float8_filter,precision]"])
def test_the_float8_filter_axis_adds_each_float8_candidate_with_torchaos_shape_filter(search):
    """autotune.search=[precision,float8_filter] (in either order): each float8 candidate, tensorwise
    and rowwise, also with torchao's shape filter (precision.filter_fqns gains
    auto_filter_small_kn, its own names kept); bf16's once. On one H200 the filter ran float8 +
    compile 6-12 % faster (BENCHMARKS.md, 2026-11-28). Every candidate's overrides validate, into
    the precision it was predicted with."""
    from titan_exp.perf.rates.devices import SPECS, spec_profile

    base = [*SMALL, *TINY, "training.global_batch_size=1", "training.local_batch_size=1", "cluster=slurm",
            "cluster.gpus_per_node=1", "precision.filter_fqns=[output]"]
    job = job_config([*base, f"autotune.search={search}"])
    gpu = candidates(job, 1, cuda=True, profile=spec_profile(SPECS["h200"], 1, 1), memory_gib=1e3)
    assert sorted(c.layout.split(", ", 1)[1] for c in gpu) == [
        "bf16", "float8", "float8, small linears bf16", "float8_rowwise", "float8_rowwise, small linears bf16"]
    for c in gpu:
        composed = job_config([*base, *c.overrides])
        assert not validate(composed, cuda=True), c.name
        assert composed.precision == c.job.precision, c.name  # predicted for the job the member runs
        assert composed.precision.filter_fqns == (["output", "auto_filter_small_kn"] if "small linears" in c.name
                                                  else ["output"])
    # where it would add nothing, it is refused before any rank starts, saying why
    (cpu,) = validate(job, cuda=False)
    assert "float8_filter: no candidate trains in float8" in cpu and "fp32 and bf16 on CPUs" in cpu
