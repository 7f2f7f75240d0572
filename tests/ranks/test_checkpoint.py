"""Checkpoints: real DCP files written by real multi-process runs (gloo), killed with SIGKILL
(TITAN_EXP_FAULT, see titan_exp/faults.py), relaunched in the same run dir, loaded into other
layouts, exported, and fed bad inputs.

Exactness: fp32 and deterministic, a resumed run's losses are bit-identical (==) to an
uninterrupted run's in the same layout; in another layout they agree to 1e-5 (the layouts
themselves agree to that, see test_parallel.py).
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMALL, run_job

from titan_exp import checkpoint
from titan_exp.checkpoint import MARKER, complete_steps, step_dir

slow = pytest.mark.slow

# 10 steps, checkpoints at 3, 6, 9 and 10.
SAVES = ["checkpoint.interval=3", "checkpoint.keep_latest_k=0"]
STEPS = [*SMALL, "training.steps=10", "checkpoint=default", *SAVES]
FSDP2 = ["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"]
LAYOUTS = {
    "single": [],
    "fsdp2": FSDP2,
    "tp2": ["parallelism=tp"],
    "pp2": ["parallelism=pp"],
    "fsdp4": ["parallelism=fsdp", "cluster.nproc_per_node=4", "training.local_batch_size=2"],
    "hsdp2x2": ["parallelism=hsdp", "training.local_batch_size=2"],
}


def ok(code, summary):
    assert code == 0 and summary["status"] == "ok", summary and summary.get("error")
    return summary


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """The uninterrupted run every resume is compared with; it also exports its model."""
    run_dir = tmp_path_factory.mktemp("fsdp2_run")
    summary = ok(*run_job([*STEPS, *FSDP2, "checkpoint.export_format=safetensors"], run_dir))
    return run_dir, summary


def test_interval_and_the_last_step_are_saved_complete(fsdp2_run):
    run_dir, summary = fsdp2_run
    folder = run_dir / "checkpoints"
    assert list(complete_steps(folder)) == [3, 6, 9, 10]
    assert summary["start_step"] == 1 and len(summary["losses"]) == 10
    for step in (3, 6, 9, 10):
        assert checkpoint.verify(step_dir(folder, step)) is None
    keys = checkpoint.read_metadata(step_dir(folder, 6)).state_dict_metadata
    assert {k.split(".")[0] for k in keys} == set(checkpoint.PARTS)


def test_resume_after_sigkill_is_bit_identical(fsdp2_run, tmp_path, monkeypatch):
    """Rank 1 is SIGKILLed after step 7; the relaunch resumes from step 6."""
    _, uninterrupted = fsdp2_run
    monkeypatch.setenv("TITAN_EXP_FAULT", "step@7:1")
    code, summary = run_job([*STEPS, *FSDP2], tmp_path)
    assert code == 1 and summary["status"] == "failed"
    assert list(complete_steps(tmp_path / "checkpoints")) == [3, 6]
    monkeypatch.delenv("TITAN_EXP_FAULT")
    summary = ok(*run_job([*STEPS, *FSDP2], tmp_path))
    assert summary["start_step"] == 7
    assert summary["losses"] == uninterrupted["losses"][6:]
    assert summary["grad_norms"] == uninterrupted["grad_norms"][6:]


def test_kill_during_async_save_keeps_the_previous_checkpoint(fsdp2_run, tmp_path, monkeypatch):
    """Every rank is killed right after handing step 9's checkpoint to the background writer:
    step-6 stays the latest, the relaunch drops whatever step 9 left and resumes from step 6
    exactly; keep_latest_k=2 then deletes complete checkpoints only."""
    _, uninterrupted = fsdp2_run
    overrides = [*SMALL, "training.steps=10", *FSDP2, "checkpoint=async", *SAVES, "checkpoint.keep_latest_k=2"]
    monkeypatch.setenv("TITAN_EXP_FAULT", "save@9")
    code, _ = run_job(overrides, tmp_path)
    assert code == 1
    folder = tmp_path / "checkpoints"
    assert list(complete_steps(folder)) == [3, 6]
    monkeypatch.delenv("TITAN_EXP_FAULT")
    summary = ok(*run_job(overrides, tmp_path))
    assert summary["start_step"] == 7
    assert summary["losses"] == uninterrupted["losses"][6:]
    assert sorted(p.name for p in folder.iterdir()) == ["step-10", "step-9"]


def test_written_but_unmarked_checkpoint_is_never_loaded(fsdp2_run, tmp_path, monkeypatch):
    """Rank 0 dies after every rank wrote step 6 (data and .metadata all there) but before
    complete.json: step 3 is the latest."""
    _, uninterrupted = fsdp2_run
    monkeypatch.setenv("TITAN_EXP_FAULT", "save@6:0")
    assert run_job([*STEPS, *FSDP2], tmp_path)[0] == 1
    step6 = step_dir(tmp_path / "checkpoints", 6)
    assert (step6 / ".metadata").exists() and not (step6 / MARKER).exists()
    monkeypatch.delenv("TITAN_EXP_FAULT")
    summary = ok(*run_job([*STEPS, *FSDP2], tmp_path))
    assert summary["start_step"] == 4
    assert summary["losses"] == uninterrupted["losses"][3:]


@pytest.mark.parametrize("name", [pytest.param(n, marks=slow) if n in ("fsdp4", "hsdp2x2") else n
                                  for n in ("single", "tp2", "pp2", "fsdp4", "hsdp2x2")])
def test_save_load_round_trip_is_bit_identical_per_layout(name, tmp_path):
    """Train 4 steps saving at 2 and 4; rerun from step 2 (load_step=2) in the same layout."""
    overrides = [*SMALL, "training.steps=4", "checkpoint=default", "checkpoint.interval=2", *LAYOUTS[name]]
    first = ok(*run_job(overrides, tmp_path))
    again = ok(*run_job([*overrides, "checkpoint.load_step=2"], tmp_path))
    assert again["start_step"] == 3
    assert again["losses"] == first["losses"][2:]


def test_tied_embeddings_save_under_fsdp_and_continue_in_one_process(tmp_path):
    """A tied model's one matrix, sharded in FSDP's unit with the output, saves under FSDP 2 and
    loads, resharded, into one process, which goes on as FSDP 2 did."""
    overrides = [*SMALL, "training.steps=4", "checkpoint=default", "checkpoint.interval=2",
                 "model.tie_word_embeddings=true"]
    first = ok(*run_job([*overrides, *FSDP2], tmp_path / "fsdp2"))
    again = ok(*run_job([*overrides, f"checkpoint.initial_load_path={tmp_path}/fsdp2/checkpoints/step-2",
                         "checkpoint.initial_load_model_only=false"], tmp_path / "single"))
    assert again["start_step"] == 3
    assert again["losses"] == pytest.approx(first["losses"][2:], abs=1e-5)


TIED = [*SMALL, "training.steps=4", "checkpoint=default", "checkpoint.interval=2", "model.tie_word_embeddings=true"]


@pytest.mark.parametrize("schedule", ["DualPipeV", pytest.param("1F1B", marks=slow)])
def test_tied_pipeline_resumes_exactly_and_continues_in_one_process(schedule, tmp_path):
    """A tied pipeline resumes bit-identically: in a V (DualPipeV) rank 0 holds the embedding and
    the last stage's copy of it, each with an optimizer of its own; under 1F1B the first and last
    rank both save the matrix's optimizer state. Its checkpoint, keyed as one process keys the tied
    matrix, goes on in one process."""
    pp = [*TIED, "parallelism=pp", f"parallelism.pipeline_parallel_schedule={schedule}"]
    first = ok(*run_job(pp, tmp_path / "pp"))
    again = ok(*run_job([*pp, "checkpoint.load_step=2"], tmp_path / "pp"))
    assert again["start_step"] == 3
    assert again["losses"] == first["losses"][2:] and again["grad_norms"] == first["grad_norms"][2:]
    single = ok(*run_job([*TIED, f"checkpoint.initial_load_path={tmp_path}/pp/checkpoints/step-2",
                          "checkpoint.initial_load_model_only=false"], tmp_path / "single"))
    assert single["losses"] == pytest.approx(first["losses"][2:], abs=1e-5)


def test_tied_one_process_checkpoint_continues_in_a_pipeline(tmp_path):
    """One process's optimizer state holds the tied matrix under the embedding's name only; the
    pipeline's last stage takes its copy's from it."""
    single = ok(*run_job(TIED, tmp_path / "single"))
    pp = ok(*run_job([*TIED, "parallelism=pp", f"checkpoint.initial_load_path={tmp_path}/single/checkpoints/step-2",
                      "checkpoint.initial_load_model_only=false"], tmp_path / "pp"))
    assert pp["start_step"] == 3
    assert pp["losses"] == pytest.approx(single["losses"][2:], abs=1e-5)
    assert pp["grad_norms"] == pytest.approx(single["grad_norms"][2:], rel=2e-4)


# Into a pipeline with -m slow: the other way (a pipeline's checkpoint without one) runs by default, below.
@pytest.mark.parametrize("name", ["single", "tp2", pytest.param("pp2", marks=slow), pytest.param("fsdp4", marks=slow)])
def test_fsdp2_checkpoint_continues_in_another_layout(name, fsdp2_run, tmp_path):
    """The full training state of FSDP 2's step 6 loads into another layout (DCP reshards it)."""
    run_dir, uninterrupted = fsdp2_run
    summary = ok(*run_job([*STEPS, *LAYOUTS[name], f"checkpoint.initial_load_path={run_dir}/checkpoints/step-6",
                           "checkpoint.initial_load_model_only=false"], tmp_path))
    assert summary["start_step"] == 7
    assert summary["losses"] == pytest.approx(uninterrupted["losses"][6:], abs=1e-5)


@slow  # 4 ranks; resharding stays in the default tier through test_fsdp2_checkpoint_continues_in_another_layout
def test_fsdp4_checkpoint_continues_under_fsdp2(tmp_path):
    """FSDP 4 -> FSDP 2: a different data-parallel degree. The data position is that of the one
    token stream every rank reads, so the new layout continues it exactly."""
    fsdp4 = ok(*run_job([*STEPS, *LAYOUTS["fsdp4"], "training.steps=6"], tmp_path / "fsdp4"))
    summary = ok(*run_job([*STEPS, *FSDP2, "training.steps=6",
                           f"checkpoint.initial_load_path={tmp_path}/fsdp4/checkpoints/step-3",
                           "checkpoint.initial_load_model_only=false"], tmp_path / "fsdp2"))
    assert summary["losses"] == pytest.approx(fsdp4["losses"][3:], abs=1e-5)


def test_pipeline_checkpoint_continues_without_pipeline(fsdp2_run, tmp_path):
    """PP 2 saves its stages from two ranks under the unsplit model's names; one process loads them."""
    pp = ok(*run_job([*STEPS, *LAYOUTS["pp2"]], tmp_path / "pp2"))
    single = ok(*run_job([*STEPS, f"checkpoint.initial_load_path={tmp_path}/pp2/checkpoints/step-6",
                          "checkpoint.initial_load_model_only=false"], tmp_path / "single"))
    assert single["start_step"] == 7
    assert single["losses"] == pytest.approx(pp["losses"][6:], abs=1e-5)


def test_seed_checkpoint_gives_the_initial_weights(reference, tmp_path):
    """A seed checkpoint made with seed 0 overrides the weights seed 7 would draw."""
    code, summary = run_job([*SMALL, "checkpoint=seed"], tmp_path)
    assert code == 0 and summary["seed_checkpoint"].endswith("step-0")
    assert complete_steps(tmp_path / "checkpoints")[0]["model_only"]
    summary = ok(*run_job([*SMALL, "checkpoint=default", "training.seed=7"], tmp_path))
    assert summary["losses"] == reference["losses"]


def test_model_only_last_save_exclusions_and_initial_weights(tmp_path):
    """`checkpoint=export`: the last save holds the model alone, in bf16, so a relaunch resumes
    from the newest full checkpoint (step 2). Excluding the optimizer restarts Adam; a new run
    taking only the weights of step 2 starts at step 1."""
    overrides = [*SMALL, "training.steps=4", "checkpoint=export", "checkpoint.interval=2", "lr_scheduler.decay_ratio=0"]
    first = ok(*run_job(overrides, tmp_path / "a"))
    folder = tmp_path / "a" / "checkpoints"
    assert complete_steps(folder)[4]["model_only"] and not complete_steps(folder)[2]["model_only"]
    saved = checkpoint.read_metadata(step_dir(folder, 4)).state_dict_metadata
    assert {k.split(".")[0] for k in saved} == {"model"}
    assert saved["model.norm.weight"].properties.dtype == torch.bfloat16
    resumed = ok(*run_job(overrides, tmp_path / "a"))
    assert resumed["start_step"] == 3 and resumed["losses"] == first["losses"][2:]
    fresh_adam = ok(*run_job([*overrides, "checkpoint.load_step=2", "checkpoint.exclude_from_loading=[optimizer]"],
                             tmp_path / "a"))
    assert fresh_adam["start_step"] == 3 and fresh_adam["losses"][0] == first["losses"][2]
    assert abs(fresh_adam["losses"][1] - first["losses"][3]) > 1e-4  # Adam restarted at step 3
    weights_only = ok(*run_job([*SMALL, "training.steps=2", "checkpoint=default",
                                f"checkpoint.initial_load_path={folder}/step-2"], tmp_path / "b"))
    assert weights_only["start_step"] == 1
    # Batch 1 again, on trained weights: lower than the fresh model's loss on it.
    assert weights_only["losses"][0] < first["losses"][0] - 0.1


def test_export_loads_without_titan_exp(fsdp2_run, tmp_path):
    """The exported safetensors file holds the final weights, whole, under the model's names;
    the CLI writes bf16 and torch-format variants of any checkpoint, and says what it wrote and
    nothing else (torch warns of any single-process DCP load: checkpoint.export)."""
    from safetensors.torch import load_file

    run_dir, _ = fsdp2_run
    exported = load_file(run_dir / "export" / "model.safetensors")
    saved = checkpoint.read_metadata(step_dir(run_dir / "checkpoints", 10)).state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert set(exported) == model_keys
    assert exported["tok_embeddings.weight"].shape == (2048, 256) and exported["norm.weight"].dtype == torch.float32
    for fmt, dtype in (("pt", "bfloat16"), ("safetensors", "float32")):
        out = tmp_path / f"model.{fmt}"
        said = subprocess.run([sys.executable, "-m", "titan_exp.checkpoint", "export", str(run_dir), "--out", str(out),
                               "--format", fmt, "--dtype", dtype], check=True, cwd=REPO, capture_output=True, text=True)
        assert "warn" not in (said.stdout + said.stderr).lower(), said.stderr
        again = load_file(out) if fmt == "safetensors" else torch.load(out, weights_only=True)
        for key, value in exported.items():
            assert torch.equal(again[key], value.to(getattr(torch, dtype))), key


@pytest.mark.slow  # HSDP x the save policies: two 4-rank runs, ~40 s
def test_hsdp_save_policies_load_identically(tmp_path):
    """HSDP 2x2: every rank writes (DCP de-duplicates replicated shards) or only the first
    replica group does (half the files, each twice as big); the weights are the same."""
    from safetensors.torch import load_file

    weights, shards = {}, {}
    for policy in ("all", "first"):
        ok(*run_job([*SMALL, "training.steps=2", "checkpoint=default", "checkpoint.interval=2", *LAYOUTS["hsdp2x2"],
                     f"checkpoint.hsdp_save_replicas={policy}", "checkpoint.export_format=safetensors"],
                    tmp_path / policy))
        marker = complete_steps(tmp_path / policy / "checkpoints")[2]
        shards[policy] = [size for name, (size, _) in marker["files"].items() if name.endswith(".distcp")]
        weights[policy] = load_file(tmp_path / policy / "export" / "model.safetensors")
    assert len(shards["all"]) == 4 and len(shards["first"]) == 2
    assert max(shards["first"]) > max(shards["all"])
    assert sum(shards["first"]) == pytest.approx(sum(shards["all"]), rel=0.01)
    for key, value in weights["all"].items():
        assert torch.equal(weights["first"][key], value), key


# --- Bad inputs: a clear error, nothing started --------------------------------------------------


def launch_errors(overrides, run_dir) -> str:
    """Launch a config that must be refused before any process starts; its error text."""
    from conftest import compose

    from titan_exp.config import to_job_config
    from titan_exp.launch import preflight
    from titan_exp.record import RunDir

    pending = preflight.Pending(to_job_config(compose(overrides)), RunDir(run_dir))
    job = preflight.data(pending)[0].job
    errors = checkpoint.preflight(job.checkpoint, Path(run_dir), preflight.model_shapes(job), job.model)
    assert errors, "expected the config to be refused"
    code, _ = run_job(overrides, run_dir)
    assert code == 2
    return "\n".join(errors)


def copy_checkpoint(fsdp2_run, tmp_path, step=6) -> Path:
    run_dir, _ = fsdp2_run
    dst = tmp_path / f"step-{step}"
    shutil.copytree(step_dir(run_dir / "checkpoints", step), dst)
    return dst


def test_load_step_that_does_not_exist(fsdp2_run):
    run_dir, _ = fsdp2_run
    before = sorted(p.name for p in run_dir.iterdir())
    error = launch_errors([*STEPS, *FSDP2, "checkpoint.load_step=5"], run_dir)
    assert "checkpoint.load_step = 5: no complete checkpoint step-5" in error and "complete steps: 3, 6, 9, 10" in error
    assert sorted(p.name for p in run_dir.iterdir()) == before


@pytest.mark.quick
def test_checkpoint_of_another_model_shape(fsdp2_run, tmp_path):
    step6 = copy_checkpoint(fsdp2_run, tmp_path)
    error = launch_errors([*STEPS, "model.n_layers=4", "model.dim=128", "model.n_heads=8",
                           f"checkpoint.initial_load_path={step6}"], tmp_path / "run")
    assert "checkpoint.initial_load_path" in error and "does not fit this model" in error
    assert "model.tok_embeddings.weight is [2048, 256] there, [2048, 128] here" in error


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "missing", "unmarked"])
@pytest.mark.quick
def test_damaged_checkpoint(damage, fsdp2_run, tmp_path):
    step6 = copy_checkpoint(fsdp2_run, tmp_path)
    shard = step6 / "__1_0.distcp"
    if damage == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    elif damage == "corrupted":
        with open(shard, "r+b") as f:
            f.seek(1000)
            f.write(b"\xff" * 64)
    elif damage == "missing":
        shard.unlink()
    else:
        (step6 / MARKER).unlink()
    error = launch_errors([*STEPS, f"checkpoint.initial_load_path={step6}"], tmp_path / "run")
    expected = {"truncated": "is truncated", "corrupted": "is corrupted", "missing": "is missing",
                "unmarked": "is not a complete checkpoint"}[damage]
    assert expected in error and "checkpoint.initial_load_path" in error


def test_read_only_folder(tmp_path):
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o555)
    else:  # root writes through permission bits; sysfs refuses even root
        folder = Path("/sys/titan_exp_checkpoints")
    error = launch_errors([*SMALL, "checkpoint=default", f"checkpoint.folder={folder}"], tmp_path / "run")
    assert f"checkpoint.folder = {folder}: cannot write" in error


def test_disk_full_during_save_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    """Files may not grow past 8 MiB (RLIMIT_FSIZE; the shard is bigger): the first save fails
    on every rank, the run says why, and nothing half-written counts as a checkpoint."""
    limit = 8 << 20

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "launch.py", *SMALL, "checkpoint=default", "checkpoint.interval=2",
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, preexec_fn=small_disk)
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "saving checkpoint step-2" in summary["error"] and "there is no earlier checkpoint" in summary["error"]
    assert complete_steps(tmp_path / "checkpoints") == {}


def test_metadata_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="never holds"):
        checkpoint.read_metadata(tmp_path)
    assert not (tmp_path / "pwned").exists()
