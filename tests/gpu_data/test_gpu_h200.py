"""What one H200 measured (benchmarks/data/gpu_h200_*, 2026-11-25, `python benchmarks/gpu_suite.py`),
checked on any machine: the planner must keep predicting those runs from the profile calibrated
there, and the trace reader must keep reading that GPU's trace as it did there."""

from __future__ import annotations

import gzip
import json
import statistics

import pytest
from conftest import REPO, as_ran, job_config

from benchmarks.gpu_suite import CONFIGS, overrides_for
from titan_exp.config import ACMode
from titan_exp.perf.calibration.fit import spearman
from titan_exp.perf.model import memory_gpu as mg
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.rates.profile import MachineProfile, model_shape, rank_key
from titan_exp.train.trace import gpu_summary
from titan_exp.validation import resolve

DATA = REPO / "benchmarks" / "data"
SUITE = json.loads((DATA / "gpu_h200_suite.json").read_text())
PROFILE = MachineProfile.from_dict(json.loads((DATA / "gpu_h200_profile.json").read_text()))
# What the GPU block model does not price, left out of the check (named from these runs, which
# showed it 51-53 % fast: no held-out evidence either way). The MoE row ran without FSDP, so
# under autocast its routed rows stayed fp32 and took the loop over experts, a host sync a layer,
# not the grouped GEMM the model prices (titan_exp.models.moe.compute_dtype, 2026-11-26): it
# measured that fault, and waits for a GPU to be run again. (Eager float8, 58 % fast until
# 2026-11-27, is priced since: torchao's casts counted, its Python fitted on the 1B's two rows,
# perf.rates.float8_casts' [torchao-eager].)
NOT_MODELLED = ("MoE 8 experts top-2, bf16 + compile",)


def rows(optimizer: str = "fused") -> list[dict]:
    return [r for r in SUITE["rows"] if r["optimizer"] == optimizer]


def job_of(row: dict):
    """The job one measured row ran (its configuration, less the suite's run-only suffixes)."""
    name = row["config"].replace(", traced", "").replace(", warm cache", "").replace(", read every step", "")
    return resolve(job_config([*overrides_for(row["model"], SUITE["shape"]["steps"], False), *CONFIGS[name],
                               *as_ran(SUITE)]))


def predicted(row: dict, profile: MachineProfile) -> float:
    """The step time (s) the planner predicts for one measured row."""
    return predict_step(job_of(row), profile, cuda=True).step_s


def test_the_calibrated_profile_is_filed_under_the_key_a_gpu_run_looks_up():
    """Calibration on the H200 wrote its profile under (nccl, 1 thread a rank): rank_key's, by
    which this_machine reads it on a GPU. (It once wrote the process group's `cuda:nccl,cpu:gloo`
    and the host's 16 threads, and every GPU run fell back to the uncalibrated defaults.)"""
    assert (PROFILE.key["backend"], PROFILE.key["threads_per_rank"]) == rank_key(True, 1)
    assert PROFILE.source == "calibrated" and PROFILE.kernels.architecture == "hopper"


def test_a_calibrated_gpu_lacks_nothing_for_a_model_it_did_not_time():
    """Its blocks are priced from their parts at its kernels' rates, so the 3B (calibrated on the
    1B) needs no block of its own timed, for autotune or the plan; without the compiled kernels'
    host cost, a compiled job does, without torchao's eager float8 Python an eager float8 job,
    without the rate of its float8 casts (Kernels.float8_cast_tb_s) or of its forward GEMMs
    (fast accumulation: matmul_tflops' float8_fast) any float8 job, and without
    the rate of the block's memory-bound kernels as the job runs them (Kernels.elementwise_tb_s,
    first measured after this calibration, 2026-11-28) any job."""
    import dataclasses

    job = resolve(job_config(overrides_for("llama3_3b", 12, False)))
    assert PROFILE.block(model_shape(job), 1) is None and PROFILE.blocks  # it timed the 1B's only
    assert PROFILE.missing(job, [1], compile=True) == ["the rate of the block's compiled memory-bound kernels"]
    assert PROFILE.missing(job, [1], compile=False) == ["the rate of the block's memory-bound kernels"]
    rates = {"eager": 3.0, "compiled": 3.0}
    kernels = dataclasses.replace(PROFILE.kernels, elementwise_tb_s=rates)
    assert dataclasses.replace(PROFILE, kernels=kernels).missing(job, [1], compile=True) == []
    eager_only = dataclasses.replace(PROFILE, kernels=dataclasses.replace(kernels, measured=("matmul_tflops",),
                                                                          elementwise_tb_s={"eager": 3.0}))
    assert eager_only.missing(job, [1], compile=True) == ["the host's cost of a compiled kernel",
                                                          "the rate of the block's compiled memory-bound kernels"]
    assert eager_only.missing(job, [1], compile=False) == []
    # torchao's Python around an eager float8 linear, and its casts' rate, were first measured
    # after this calibration (2026-11-27, 2026-11-28)
    float8 = resolve(job_config([*overrides_for("llama3_3b", 12, False), "precision=float8"]))
    forward = "the rate of torchao's forward float8 GEMMs (fast accumulation)"  # float8_fast, since 2026-11-28
    assert PROFILE.missing(float8, [1], compile=False) == ["the host's cost of an eager float8 linear",
                                                           "the rate of torchao's float8 casts", forward,
                                                           "the rate of the block's memory-bound kernels"]
    assert dataclasses.replace(PROFILE, kernels=kernels).missing(float8, [1], compile=True) == [
        "the rate of torchao's float8 casts", forward]


def test_the_planner_predicts_one_h200s_runs_from_its_calibrated_profile():
    """Issue 38's targets on every modelled run: tokens/s ranked with Spearman >= 0.9, median
    |error| <= 10 %; the spec sheet's errors beside them must stay larger (or the calibration is
    not what makes the fit)."""
    modelled = [r for r in rows() if r["config"] not in NOT_MODELLED]
    assert len(modelled) == 15
    measured = [r["step_s"] for r in modelled]
    calibrated = [predicted(r, PROFILE) for r in modelled]
    spec = [predicted(r, spec_profile(SPECS["h200"], 1, 1)) for r in modelled]
    errors = [abs(p / m - 1) for p, m in zip(calibrated, measured)]
    spec_errors = [abs(p / m - 1) for p, m in zip(spec, measured)]
    assert spearman([1 / s for s in calibrated], [1 / s for s in measured]) >= 0.9
    assert statistics.median(errors) <= 0.10, errors
    assert max(errors) <= 0.20, errors
    assert statistics.median(spec_errors) > statistics.median(errors)


def test_the_planner_predicts_one_h200s_peak_memory():
    """Issue 37's memory target on every run with the default optimizer (fused AdamW): within 10 %
    of the allocator's reserved peak. The tensors the planner counts (perf.model.memory_gpu's one replica
    under autocast: the states at the peak's moment, autocast's weight copies, what each block
    saves, the loss) are within 8 % of the allocated peak, over on all but five (median 3.0 %,
    worst 7.7 %; five under by 1-2 %; within 11 %, median 5.5 %, before float8's blocks were
    counted without the compiled bf16 block's CUDA_EXTRA, 2026-11-28): predicted as what ran, an
    untied output (as_ran), they were within 4 % of it while the planner took these models for
    tied, which two of the account's values, inferred from the bf16 + compile rows
    (memory_gpu.CUDA_EXTRA, LOSS_UNITS), made up for. The MoE row takes the fitted model
    (memory_gpu.autocast_replica counts dense blocks), written for bf16 parameters under FSDP, TP
    or PP: 9.5 % over since that account holds this toolkit's compiled loss (parallel.compiles_loss,
    2026-12-02: 6 bytes a logit, where it took 10, and was 22 % over; 10 % before that, when an
    activation share 0.53 fitted with a guessed selective-AC share cancelled the loss's and the
    MoE saves' excess). Seen before either change: not a check of the account."""
    over = []
    for r in rows():
        parts = predict_memory(job_of(r), cuda=True)
        allocated = parts["total"] - parts["rounding"] - parts["workspaces"]
        assert abs(parts["total"] / r["peak_memory_gib"] - 1) <= 0.10, (r["model"], r["config"], parts["total"])
        if "MoE" not in r["config"]:
            over.append(allocated / r["peak_allocated_gib"] - 1)
    assert max(map(abs, over)) < 0.08 and sum(o < 0 for o in over) == 5 and 0.025 < statistics.median(over) < 0.035


def saved_by_one_block(job, compiled: bool = False, seq: int = 64) -> float:
    """Bytes a token that one of this toolkit's blocks of `job`'s shape, precision, compile and AC
    saves for backward under bf16 autocast, counted here with autograd's saved-tensor hooks on a
    short sequence (a token's share does not depend on its length), compiled by Inductor for this
    CPU where `compiled`. The block's input and parameters, saved as they are, take no new memory;
    nor do autocast's bf16 copies of its weights (shaped as one), which perf.model.memory_gpu counts
    apart."""
    import torch
    from torch import nn

    from titan_exp.models.llama import TransformerBlock, rope_tables
    from titan_exp.parallel.activation_checkpoint import apply_ac
    from titan_exp.parallel.compile import apply_compile
    from titan_exp.precision import apply_converter

    m = job.model
    holder = nn.Module()
    holder.layers = nn.ModuleDict({"0": TransformerBlock(m)})
    params = list(holder.parameters())
    apply_converter(holder, job.precision)
    if job.activation_checkpoint.mode != ACMode.none:
        apply_ac(holder, job.activation_checkpoint.mode, job.activation_checkpoint.selective_ac_option)
    if compiled:
        apply_compile(holder, "inductor", fullgraph=False)
    cos, sin = rope_tables(m.head_size, seq, m.rope_theta)
    weights = {tuple(p.shape) for p in params} | {tuple(p.shape[::-1]) for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        if tuple(t.shape) not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(1, seq, m.dim, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        holder.layers["0"](x, cos, sin)
    held = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *params)}  # saved, not made
    return sum(n for ptr, n in saved.items() if ptr not in held) / seq


@pytest.mark.parametrize("model, precision, compiled, ac", [
    ("llama3_1b", "bf16", False, "none"), ("llama3_3b", "bf16", False, "none"), ("llama3_1b", "float8", False, "none"),
    ("llama3_1b", "bf16", True, "none"),
    pytest.param("llama3_3b", "float8", True, "none", marks=pytest.mark.slow),
    pytest.param("llama3_1b", "bf16", True, "selective", marks=pytest.mark.slow),
    pytest.param("llama3_3b", "float8_rowwise", True, "selective", marks=pytest.mark.slow),
])
def test_what_a_block_saves_is_counted_on_the_block(model, precision, compiled, ac):
    """perf.model.memory_gpu.AUTOCAST_SAVED is what this toolkit's block saves, recounted here on the
    block itself (without the CUDA-only CUDA_EXTRA); the 8B's shape, on which the counts were
    checked when written, takes a minute a mode. Within a byte: float8's scales, a few fp32
    scalars a block, are no bytes a token."""
    job = resolve(job_config(overrides_for(model, SUITE["shape"]["steps"], False) + [
        f"precision={precision}", f"activation_checkpoint.mode={ac}"]))
    mode = "selective" if ac == "selective" else "compiled" if compiled else "eager"
    assert saved_by_one_block(job, compiled) == pytest.approx(mg.autocast_saved(job, mode, cuda=False), abs=1)


def test_the_gpu_trace_reads_one_steps_own_device_work(tmp_path):
    """titan_exp.train.trace.gpu_summary on the bf16 + compile step traced on the H200: of the
    2,790 kernels in the file, the 1,937 the step's host range launched. The others are the
    previous step's optimizer phase, still running when the range opened: read with them, the
    step's fused AdamW took twice its time (68 ms, BENCHMARKS.md until 2026-11-28). Busy time by
    kind adds up to the kernels' time, the optimizer phase one AdamW and one gradient norm."""
    trace = DATA / "gpu_h200_trace_llama3_3b_bf16_compile.json.gz"
    path = tmp_path / "trace.json"
    path.write_bytes(gzip.decompress(trace.read_bytes()))
    events = json.loads(path.read_text())["traceEvents"]
    here = gpu_summary(path)
    assert sum(e.get("cat") == "kernel" for e in events) == 2790 and here["kernels"] == 1937
    assert here["idle_s"] / here["window_s"] < 0.02 and here["compiled_regions"] == 29
    kinds = here["busy_by_kind_ms"]
    assert sum(kinds.values()) == pytest.approx(here["busy_s"] * 1e3, rel=0.01)
    assert (kinds["optimizer"] == pytest.approx(34.2, abs=0.1)
            and kinds["gemm"] > kinds["attention"] > kinds["memory_bound"])
