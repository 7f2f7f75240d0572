"""The launch path end to end: launch.py -> validation -> run dir -> rank processes -> summary."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, SMALL, launch_cli, read_summary, run_job

from titan_exp.record import RunDir

RUN_FILES = ("config.yaml", "tokenizer.json", "metrics.jsonl", "summary.json", "logs")


def test_cli_single_and_fsdp2_give_the_same_losses(tmp_path):
    """The issue's headline: 1 rank and 2 FSDP ranks, fp32, deterministic, same losses."""
    single = launch_cli([f"hydra.run.dir={tmp_path / 'single'}", *SMALL])
    assert single.returncode == 0, single.stderr[-3000:]
    fsdp = launch_cli([f"hydra.run.dir={tmp_path / 'fsdp'}", "parallelism=fsdp", "cluster.nproc_per_node=2",
                       "training.local_batch_size=4", *SMALL])
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    a, b = RunDir(tmp_path / "single"), RunDir(tmp_path / "fsdp")
    sa, sb = read_summary(a.path), read_summary(b.path)
    assert sa["status"] == sb["status"] == "ok"
    assert sb["world_size"] == 2 and sb["layout"]["dp_shard"] == 2
    assert len(sa["losses"]) == 5
    assert sa["losses"] == pytest.approx(sb["losses"], abs=1e-5)
    assert sa["grad_norms"] == pytest.approx(sb["grad_norms"], rel=2e-4)  # see test_parallel.py
    # The run record: every file, a progress line per log step, and a summary with the numbers.
    for name in RUN_FILES:
        assert (b.path / name).exists(), name
    assert (b.path / "logs" / "rank-1.log").exists()
    assert [m["step"] for m in a.read_metrics()] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm", "lr", "tps_per_device", "mfu", "peak_memory_gib"):
        assert key in a.read_metrics()[-1]
    for key in ("tokens_per_second_per_device", "mfu", "peak_memory_gib", "final_loss", "wall_time_s"):
        assert sa[key] > 0, key
    assert "step    5 | loss" in single.stdout + single.stderr
    # The ranks were built from the resolved config: derived values are numbers.
    assert "data_parallel_shard_degree: 2" in (b.path / "config.yaml").read_text()
    assert "global_batch_size: 8" in (b.path / "config.yaml").read_text()


@pytest.mark.parametrize("layout", [
    ["parallelism=2d", "precision=float8", "training.local_batch_size=4"],
    pytest.param(["parallelism=hsdp", "precision=mxfp8", "training.local_batch_size=2"], marks=pytest.mark.slow),
    ["parallelism=ep", "model=moe_debug", "training.local_batch_size=4"],
], ids=["2d_float8", "hsdp_mxfp8", "ep"])
def test_fsdp_with_tp_hsdp_and_ep_runs_print_no_warning(tmp_path, layout):
    """What a user sees of a 2-D (FSDP 2 x TP 2) float8, an HSDP 2 x 2 MXFP8 (in the slow tier) and
    an expert-parallel (EP 2) run: their steps and no warning. torch 2.13 warns, once a rank, where
    FSDP wraps a module that returns a view (the TP embedding's `to_local`, copied:
    parallel.tensor), where a DTensor reduces over two mesh dims one after the other (the gradient
    norm, over dp_shard_cp_tp, or the experts' over dp_shard's two parts: parallel.dims) and where a
    flattened mesh is sliced out of the world mesh again (kept instead: ParallelDims.flattened);
    importing torchao on a CPU warns of its CUDA libraries and Triton, and torch of torchao's
    pytree enums (precision.torchao_imports)."""
    out = launch_cli([f"hydra.run.dir={tmp_path}", *layout, *SMALL])
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert "step    5 | loss" in said
    for noise in ("warn", "deprecat", "failed to load", "sequential all_reduce"):
        assert noise not in said.lower(), said[-3000:]


@pytest.mark.quick
def test_invalid_config_starts_nothing_and_writes_nothing(tmp_path):
    out = launch_cli([f"hydra.run.dir={tmp_path}", "parallelism=tp", "parallelism.tensor_parallel_degree=3"])
    assert out.returncode == 2
    assert "parallelism.tensor_parallel_degree = 3: does not divide model.n_heads = 16" in out.stdout + out.stderr
    for name in RUN_FILES:
        assert not (tmp_path / name).exists(), name


def test_failure_still_writes_a_summary(tmp_path):
    """A rank that raises mid-run: the summary says failed, with the error, and the exit code too."""
    code, summary = run_job([*SMALL, "data.text_field=body"], tmp_path)
    assert code == 1
    assert summary["status"] == "failed"
    assert "KeyError" in summary["error"] and "body" in summary["error"]
    assert summary["wall_time_s"] > 0


def test_debug_executor_runs_in_process_with_every_sink(tmp_path):
    code, summary = run_job(
        [*SMALL, "cluster=debug", "training.steps=3", "metrics.enable_tensorboard=true", "metrics.enable_wandb=true"],
        tmp_path,
    )
    assert code == 0 and summary["status"] == "ok" and len(summary["losses"]) == 3
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_multirun_records_invalid_members_and_goes_on(tmp_path):
    out = launch_cli(["-m", f"hydra.sweep.dir={tmp_path}", *SMALL, "training.steps=2",
                      "parallelism.tensor_parallel_degree=1,3"])
    assert out.returncode == 1, out.stderr[-3000:]  # not every member succeeded
    assert "1 of 2 members ok (1 invalid, 1 ok)" in out.stdout + out.stderr
    ok, invalid = (json.loads((tmp_path / str(i) / "summary.json").read_text()) for i in (0, 1))
    assert ok["status"] == "ok"
    assert invalid["status"] == "invalid" and "does not divide model.n_heads" in invalid["error"]


@pytest.mark.quick
def test_cpu_ranks_get_a_fixed_mmap_threshold(monkeypatch):
    """glibc's dynamic threshold lets FSDP's buffers fragment the heap (RSS ~2x); ranks get a
    fixed one unless the user set their own or asked for glibc's default."""
    from conftest import job_config

    from titan_exp.config.cluster import rank_env

    def env(overrides):
        return rank_env(job_config(overrides).cluster, threads=1, gpu=False)

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert env([])["MALLOC_MMAP_THRESHOLD_"] == str(16 << 20)
    assert "MALLOC_MMAP_THRESHOLD_" not in env(["cluster.cpu_malloc_mmap_threshold_mib=null"])
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert "MALLOC_MMAP_THRESHOLD_" not in env([])


@pytest.mark.quick
def test_gpu_ranks_get_expandable_segments(monkeypatch):
    """GPU ranks' caching allocator grows its segments in place (TorchTitan's setting), so what it
    reserves follows what is allocated; not with cluster.cuda_expandable_segments=false, nor
    over the user's own PYTORCH_CUDA_ALLOC_CONF; CPU ranks get none."""
    from conftest import job_config

    from titan_exp.config.cluster import rank_env

    def env(overrides, gpu=True):
        return rank_env(job_config(overrides).cluster, threads=1, gpu=gpu)

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert env([])["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env([], gpu=False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env(["cluster.cuda_expandable_segments=false"])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env([])


def test_a_sharding_preset_on_one_cpu_process_says_so(tmp_path, caplog):
    """parallelism=fsdp without cluster.nproc_per_node on a CPU runs one process: it still runs,
    and the launcher says loudly that nothing is sharded and how to get ranks."""
    code, summary = run_job([*SMALL, "parallelism=fsdp", "training.steps=3"], tmp_path)
    assert code == 0 and summary["world_size"] == 1
    assert ("runs ONE process on this CPU and dp_shard = -1 shards over nothing; set cluster.nproc_per_node=N"
            in caplog.text)


def test_a_checkout_launched_from_another_directory_runs_its_own_code_in_the_ranks(tmp_path):
    """`python path/to/launch.py` from elsewhere: the ranks (`python -m titan_exp.train.rank`)
    import the checkout's titan_exp, the one the launcher validated, and not what their working
    directory's sys.path finds (here the editable install of this repository)."""
    checkout, elsewhere, run_dir = tmp_path / "checkout", tmp_path / "elsewhere", tmp_path / "run"
    for name in ("titan_exp", "conf", "sweeps", "hydra_plugins"):
        shutil.copytree(REPO / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("launch.py", "pyproject.toml"):
        shutil.copy(REPO / name, checkout / name)
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, str(checkout / "launch.py"), *SMALL, "training.steps=2",
                          f"hydra.run.dir={run_dir}"], cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"titan_exp from {checkout / 'titan_exp' / 'train'}," in (run_dir / "logs" / "rank-0.log").read_text()


def test_unset_ranks_take_every_visible_gpu(tmp_path, monkeypatch):
    """With GPUs (their count stands in for CUDA here), an unset nproc_per_node and a -1 degree take
    one rank per visible GPU, as torchrun's `gpu` does; more ranks than GPUs is refused at launch."""
    import torch
    from conftest import job_config

    from titan_exp.launch.preflight import Pending, ranks
    from titan_exp.validation import validate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    pending, errors = ranks(Pending(job_config(["parallelism=fsdp"]), RunDir(tmp_path)))
    assert not errors and pending.job.cluster.nproc_per_node == 4 and pending.job.world_size == 4
    errors = validate(job_config(["parallelism=fsdp", "cluster.nproc_per_node=8"]), cuda=True)
    assert any(e.startswith("cluster.nproc_per_node = 8: one rank per GPU, and this machine shows 4") for e in errors)


def test_cpu_ranks_fork_from_a_server_and_start_as_a_fresh_process_would(tmp_path, monkeypatch):
    """Local CPU ranks fork from a server that imported them once (titan_exp.cluster.forkserver); a
    rank forked so sees what a fresh `python -m` rank sees: its arguments, the launcher's environment
    as it is now, its share of threads and the fixed malloc threshold (which a fresh process takes
    from the environment at start). With cluster.fork_ranks=false, and once a variable that torch
    reads on import differs from the server's, ranks start fresh. The server has imported the
    libraries every rank needs (RANK_LIBRARIES); a Hugging Face cache set after it started is seen,
    as `datasets` reads it on import, by ranks that start fresh, while the download settings that
    importing lm_eval sets in the launcher (validating eval.tasks) leave them forked."""
    import os

    from conftest import job_config

    from titan_exp.cluster.forkserver import RANK_LIBRARIES
    from titan_exp.cluster.local import run_local

    two = [*SMALL, "parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"]

    def probe(name: str, overrides=()) -> list[dict]:
        run_dir = tmp_path / name
        run_dir.mkdir()
        assert run_local(job_config([*two, *overrides]), RunDir(run_dir), entry="tests.rank_probe") is None
        return [json.loads((run_dir / f"probe-{rank}.json").read_text()) for rank in range(2)]

    later = "set after the server started"
    monkeypatch.setenv("TITAN_EXP_PROBE", later)
    import lm_eval  # noqa: F401 - as validating eval.tasks does: it sets HF_XET_HIGH_PERFORMANCE

    forked = probe("forked")
    asked = probe("asked", ["cluster.fork_ranks=false"])
    with monkeypatch.context() as hf_cache:  # the server's again after it, so that only PYTORCH_ differs then
        hf_cache.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
        hf = probe("hf")
    monkeypatch.setenv("PYTORCH_TITAN_EXP_PROBE", later)  # as torch's variables are named
    fresh = probe("fresh")
    assert all(seen["preloaded"] == list(RANK_LIBRARIES) for seen in forked)
    assert all(seen["preloaded"] == [] for seen in asked + hf + fresh)
    assert {seen["hf_datasets_cache"] for seen in hf} == {str(tmp_path / "hf")}
    assert str(tmp_path / "hf") not in {seen["hf_datasets_cache"] for seen in forked + fresh}
    for ranks, name, torch_variable in ((forked, "forked", None), (asked, "asked", None), (hf, "hf", None),
                                        (fresh, "fresh", later)):
        for rank, seen in enumerate(ranks):
            assert seen["argv"] == [str(tmp_path / name)] and seen["RANK"] == str(rank) and seen["WORLD_SIZE"] == "2"
            assert seen["OMP_NUM_THREADS"] == "1" and seen["threads"] == 1
            assert seen["MALLOC_MMAP_THRESHOLD_"] == str(16 << 20) and seen["mmaps_17_mib"]
            assert seen["PYTHONPATH"].split(os.pathsep)[0] == str(REPO)
            assert seen["TITAN_EXP_PROBE"] == later and seen["PYTORCH_TITAN_EXP_PROBE"] == torch_variable
    assert os.getpid() not in {seen["parent"] for seen in forked}  # the server's children
    assert [seen["name"] for seen in forked] == ["titan-rank-0", "titan-rank-1"]  # for ps and pgrep
    assert {seen["parent"] for seen in asked + hf + fresh} == {os.getpid()}  # this process's own (spawn)
