"""Precision, torch.compile and activation checkpointing, composed with the layouts."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SMALL, run_job

slow = pytest.mark.slow

LAYOUTS = {
    "single": [],
    "fsdp2": ["parallelism=fsdp", "cluster.nproc_per_node=2", "training.local_batch_size=4"],
    "tp2": ["parallelism=tp"],
    "pp2": ["parallelism=pp"],
}
LOW_PRECISION = ["float8", "float8_rowwise", "mxfp8"]

# Every precision runs on one process by default, and float8 (the headline's) under FSDP too, as
# TorchTitan trains it; the rest of the matrix (with TP, with PP) is marked slow.
MATRIX = [
    pytest.param(precision, layout,
                 marks=() if layout == "single" or (precision, layout) == ("float8", "fsdp2") else slow)
    for precision in ["bf16", "full_bf16", *LOW_PRECISION]
    for layout in LAYOUTS
]


@pytest.mark.parametrize("precision,layout", MATRIX)
def test_precision_trains_in_every_layout(precision, layout, bf16_reference, tmp_path):
    if (precision, layout) == ("bf16", "single"):
        summary = bf16_reference  # that very run: not run twice (bf16 is slow on CPUs without AVX512-BF16)
    else:
        code, summary = run_job([*SMALL, f"precision={precision}", *LAYOUTS[layout]], tmp_path)
        assert code == 0, summary.get("error")
    assert summary["status"] == "ok", summary.get("error")
    assert summary["precision"] == precision
    losses = summary["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) < sum(losses[:2])  # decreasing on average
    # Low precision tracks bf16: measured <= 3.2e-3 over these 5 steps of the debug model (full_bf16 the most).
    assert losses == pytest.approx(bf16_reference["losses"], abs=2e-2)
    if precision in LOW_PRECISION:
        assert losses != bf16_reference["losses"]  # the converted linears really ran


@pytest.mark.parametrize(
    "ac,layout",
    [pytest.param(["activation_checkpoint.mode=full"], "single", marks=pytest.mark.quick),
     (["activation_checkpoint.mode=selective"], "single"),
     (["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"], "single"),
     (["activation_checkpoint.mode=selective"], "fsdp2"),
     (["activation_checkpoint.mode=selective"], "tp2"),
     (["activation_checkpoint.mode=full"], "pp2")],
    ids=["full", "selective_op", "selective_every_2nd", "selective_op_fsdp2", "selective_op_tp2", "full_pp2"],
)
def test_activation_checkpointing_gives_the_same_losses(ac, layout, reference, tmp_path):
    """Recomputation changes memory, never the math (fp32): measured identical to <= 1e-6."""
    code, summary = run_job([*SMALL, *ac, *LAYOUTS[layout]], tmp_path)
    assert code == 0, summary.get("error")
    assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-5)
    assert summary["grad_norms"] == pytest.approx(reference["grad_norms"], rel=2e-4)


# With TP: tests/test_compile_tp.py.
@pytest.mark.parametrize("layout", ["single", pytest.param("fsdp2", marks=slow), pytest.param("pp2", marks=slow)])
def test_compile_matches_eager(layout, reference, tmp_path):
    code, summary = run_job([*SMALL, "compile.enable=true", *LAYOUTS[layout]], tmp_path)
    assert code == 0, summary.get("error")
    assert summary["losses"] == pytest.approx(reference["losses"], abs=1e-4)
    # Inductor's cache was used: warm, cold, or partial, as a cold cache is where a graph compiled
    # again in the run (a pipeline stage's block, the same shapes) hits the entry its first compile wrote.
    assert summary["compile_s"] > 0 and summary["compile_cache"] in ("cold", "warm", "partial")


def test_compiled_graphs_are_cached_per_config():
    """Configs whose collectives (or anything else compiled) differ never share an FX graph entry,
    even when their graphs are identical: each config's cache tag is its own."""
    from conftest import job_config

    from titan_exp.parallel.compile import compile_cache_tag

    single = compile_cache_tag(job_config(["compile.enable=true"]))
    assert single == compile_cache_tag(job_config(["compile.enable=true", "training.steps=3"]))
    for other in (["parallelism=tp"], ["precision=float8"], ["activation_checkpoint.mode=full"],
                  ["parallelism.enable_async_tensor_parallel=true"], ["parallelism=fsdp", "cluster.nproc_per_node=2"]):
        assert compile_cache_tag(job_config(["compile.enable=true", *other])) != single, other


@slow
def test_compiled_runs_find_their_graphs_and_share_kernels(tmp_path):
    """Three compiled runs (37 s): the same config finds all of its graphs again; another config
    (a parallelism field that changes no graph on one rank) finds none of them; all share one
    inductor dir, so the kernels compiled for one are there for the next."""
    base = [*SMALL, "compile.enable=true", "training.steps=2"]
    # On one rank the reshard mode changes no graph; it is in the key all the same, as every
    # parallelism field is (one that changes collectives must never share a graph).
    members = {"a": base, "a_again": base, "b": [*base, "parallelism.fsdp_reshard_after_forward=always"]}
    runs = {name: run_job(overrides, tmp_path / name)[1] for name, overrides in members.items()}
    assert len({r["compile_cache_dir"] for r in runs.values()}) == 1  # one shared dir
    assert runs["a_again"]["compile_cache"] == "warm" and runs["a_again"]["fx_graph_cache_hits"] > 0
    assert runs["a_again"]["compile_cache_tag"] == runs["a"]["compile_cache_tag"] != runs["b"]["compile_cache_tag"]
    assert runs["b"]["fx_graph_cache_hits"] == 0 and runs["b"]["fx_graph_cache_misses"] > 0
    assert runs["b"]["losses"] == pytest.approx(runs["a"]["losses"], abs=1e-6)


@slow  # compile x float8 rowwise x selective AC, two compiled runs: about 2 minutes on 2 slow cores
def test_compiled_float8_rowwise_recomputes_what_its_forward_computed(tmp_path):
    """float8 with rowwise scales, compiled: selective AC gives the losses and gradient norms of no
    AC to the bit, as activation checkpointing must (recomputation changes memory, never the math).
    Without Inductor rounding as eager does (precision.compile_rounds_as_eager) the two runs differed
    from the first step (5e-5 in the loss, on CPU), and on an H200 the 8B's width went non-finite."""
    base = [*SMALL, "precision=float8_rowwise", "compile.enable=true", "training.steps=3"]
    runs = {ac: run_job([*base, f"activation_checkpoint.mode={ac}"], tmp_path / ac)[1] for ac in ("none", "selective")}
    assert all(r["status"] == "ok" for r in runs.values()), {ac: r.get("error") for ac, r in runs.items()}
    assert runs["selective"]["losses"] == runs["none"]["losses"]
    assert runs["selective"]["grad_norms"] == runs["none"]["grad_norms"]


@slow
def test_everything_at_once(bf16_reference, tmp_path):
    """float8 with FSDP float8 all-gather and precomputed scales, selective AC, compile, FSDP 2."""
    code, summary = run_job(
        [*SMALL, "precision=float8", "precision.float8_enable_fsdp_all_gather=true",
         "precision.float8_precompute_dynamic_scale_for_fsdp=true", "activation_checkpoint.mode=selective",
         "compile.enable=true", *LAYOUTS["fsdp2"]],
        tmp_path,
    )
    assert code == 0, summary.get("error")
    assert summary["losses"] == pytest.approx(bf16_reference["losses"], abs=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="async TP needs 2 CUDA GPUs with NCCL")
def test_async_tp_matches_plain_tp_on_cuda(reference, tmp_path):
    plain = run_job([*SMALL, "parallelism=tp", "compile.enable=true"], tmp_path / "plain")[1]
    assert plain["losses"] == pytest.approx(reference["losses"], abs=1e-4)
    fused = run_job([*SMALL, "parallelism=tp", "compile.enable=true",
                     "parallelism.enable_async_tensor_parallel=true"], tmp_path / "async")[1]
    assert plain["status"] == fused["status"] == "ok"
    assert fused["losses"] == pytest.approx(plain["losses"], abs=1e-4)
