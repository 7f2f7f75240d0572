"""The planner's optimizer time under optimizer=muon: every rank's Newton-Schulz over every matrix
of its blocks, counted against a built model, and Muon's all-gathers under FSDP and TP."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import job_config

from titan_exp import targets
from titan_exp.perf.model.comm import StepShape, muon_gathers
from titan_exp.perf.model.step import newton_schulz_s, predict_step
from titan_exp.perf.rates.devices import profile_for
from titan_exp.perf.rates.profile import Line, defaults
from titan_exp.train import muon
from titan_exp.validation import resolved

pytestmark = pytest.mark.quick

SHAPE = ["training.seq_len=64", "training.global_batch_size=8"]
LAYOUTS = {"1 process": [], "FSDP 2": ["parallelism=fsdp", "cluster.nproc_per_node=2"],
           "TP 2": ["parallelism.tensor_parallel_degree=2", "cluster.nproc_per_node=2"]}
PER_FLOP = 1e-12  # a matmul line of 1 TFLOP/s and no latency: seconds are FLOPs x 1e-12


def cpu(world: int, gemm: Line | None = None):
    profile = defaults("cpu", "gloo", world, 1)
    return dataclasses.replace(profile, gemm={"float32": gemm}) if gemm else profile


def built_flops(model: str) -> float:
    """Newton-Schulz FLOPs of one step over the built model's Muon matrices, counted here: for each
    m x n matrix (m <= n; each expert of a stack) 5 x (4 m^2 n + 2 m^3)."""
    job = job_config([f"model={model}", "optimizer=muon"])
    with torch.device("meta"):
        built = targets.build(job, "model", job.model)
    flops = 0
    for name, p in built.named_parameters():
        if muon.is_matrix(name, p.shape):
            m, n = sorted(p.shape[-2:])
            flops += (p.shape[0] if p.ndim == 3 else 1) * 5 * (4 * m * m * n + 2 * m ** 3)
    return flops


@pytest.mark.parametrize("model", ["debugmodel", "moe_debug", "deepseek_v3_debug", "qwen3_0.6b"])
def test_newton_schulz_counts_every_matrix_of_the_built_model(model):
    """One process, every block: the planner's Newton-Schulz seconds at 1e-12 s a FLOP are the
    built model's FLOPs (attention, SwiGLU, shared experts, each routed expert; MLA's linears)."""
    job = job_config([*SHAPE, f"model={model}", "optimizer=muon"])
    s = StepShape.of(job, cpu(1, Line(0.0, PER_FLOP)), False)
    assert newton_schulz_s(s, s.loads[0]) / PER_FLOP == pytest.approx(built_flops(model), rel=1e-9)


def optimizer_s(overrides: list[str], optimizer: str, world: int = 1) -> float:
    job = job_config([*SHAPE, *overrides, f"optimizer={optimizer}"])
    return predict_step(job, cpu(world), cuda=False).parts["optimizer"]


def test_muon_optimizer_time_exceeds_adamw_and_grows_with_the_matrices():
    """Muon's extra optimizer time is its Newton-Schulz, ~m^2 n a matrix: twice the width, ~8x."""
    small = optimizer_s([], "muon") - optimizer_s([], "adamw")
    wide = optimizer_s(["model.dim=512"], "muon") - optimizer_s(["model.dim=512"], "adamw")
    assert 0 < small and 6 * small < wide < 8 * small


def test_pipeline_stages_share_the_newton_schulz():
    """Each pipeline rank orthogonalises its own stage's matrices: the slowest rank's is less."""
    pp = ["parallelism.pipeline_parallel_degree=2", "cluster.nproc_per_node=2", "training.local_batch_size=8"]
    assert optimizer_s(pp, "muon", 2) - optimizer_s(pp, "adamw", 2) < optimizer_s([], "muon") - optimizer_s([], "adamw")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_gathers_under_fsdp_and_tp_not_in_one_process(layout):
    overrides = [*SHAPE, *LAYOUTS[layout], "training.local_batch_size=4"]
    world = 1 if layout == "1 process" else 2
    parts = {o: predict_step(job_config([*overrides, f"optimizer={o}"]), cpu(world), cuda=False).parts
             for o in ("adamw", "muon")}
    job = resolved(job_config([*overrides, "optimizer=muon"]))  # parallelism=fsdp's -1: every rank
    s = StepShape.of(job, cpu(world), False)
    gathers = muon_gathers(s, s.loads[0])
    expected = {"1 process": set(), "FSDP 2": {"fsdp"}, "TP 2": {"tp"}}[layout]
    assert set(gathers) == expected and all(t > 0 for t in gathers.values())
    for part in ("fsdp", "tp"):
        assert parts["muon"].get(part, 0.0) == pytest.approx(parts["adamw"].get(part, 0.0) + gathers.get(part, 0.0))


def test_routed_experts_split_by_experts_are_orthogonalised_by_their_rank_only():
    """A stack split along its experts (EP 2, or FSDP 2 sharding dim 0) keeps each rank's experts
    whole: each rank orthogonalises half of every stack, and gathers none of it."""
    base = [*SHAPE, "model=moe_debug", "optimizer=muon", "training.local_batch_size=4"]
    fsdp = ["parallelism=fsdp", "cluster.nproc_per_node=2"]
    layouts = {"1 process": [], "FSDP 2": fsdp, "EP 2": [*fsdp, "parallelism.expert_parallel_degree=2"]}
    flops, gathered = {}, {}
    for name, layout in layouts.items():
        job = resolved(job_config([*base, *layout]))
        s = StepShape.of(job, cpu(job.world_size, Line(0.0, PER_FLOP)), False)
        flops[name] = newton_schulz_s(s, s.loads[0]) / PER_FLOP
        gathered[name] = muon_gathers(s, s.loads[0]).get("fsdp", 0.0)
    m = job_config(base).model
    routed = m.n_moe_layers * m.n_experts * 3 * 5 * (4 * m.dim ** 2 * m.expert_hidden_dim + 2 * m.dim ** 3)
    assert flops["1 process"] - flops["FSDP 2"] == pytest.approx(routed / 2)
    assert flops["EP 2"] == pytest.approx(flops["FSDP 2"])
    assert gathered["FSDP 2"] > 0  # the blocks' other matrices
    assert gathered["EP 2"] == pytest.approx(gathered["FSDP 2"])


def test_the_plan_prices_muon_on_gpus():
    """llama3_8b on 64 H100s: Muon costs every layout time, a pipeline stage a quarter of what the
    whole model costs each FSDP rank; a planner that ignored optimizer=muon would rank both alike."""
    profile = profile_for("h100", 64, 8, None)
    layouts = {"dp_shard64": ["parallelism.data_parallel_shard_degree=64"],
               "pp4 x dp_shard16": ["parallelism.pipeline_parallel_degree=4",
                                    "parallelism.data_parallel_shard_degree=16", "training.local_batch_size=4"]}
    extra = {}
    for name, layout in layouts.items():
        steps = [predict_step(job_config(["model=llama3_8b", "training.global_batch_size=64", *layout,
                                          f"optimizer={o}"]), profile, cuda=True).parts for o in ("adamw", "muon")]
        extra[name] = steps[1]["optimizer"] - steps[0]["optimizer"]
    assert extra["dp_shard64"] > 0.3  # ~6.7e14 FLOPs of Newton-Schulz on every rank
    assert extra["pp4 x dp_shard16"] == pytest.approx(extra["dp_shard64"] / 4, rel=0.05)
