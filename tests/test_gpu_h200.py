"""What one H200 measured (benchmarks/data/gpu_h200_*, 2026-11-25, `python benchmarks/gpu_suite.py`),
checked on any machine: the planner must keep predicting those runs from the profile calibrated
there, and the trace reader must keep reading that GPU's trace as it did there."""

from __future__ import annotations

import gzip
import json
import statistics
import sys

import pytest
from conftest import REPO, job_config

sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_suite import CONFIGS, overrides_for  # noqa: E402

from titan_exp.perf.devices import SPECS, spec_profile  # noqa: E402
from titan_exp.perf.fit import spearman  # noqa: E402
from titan_exp.perf.memory import predict_memory  # noqa: E402
from titan_exp.perf.profile import MachineProfile, model_shape, rank_key  # noqa: E402
from titan_exp.perf.step import predict_step  # noqa: E402
from titan_exp.perf.trace import gpu_summary  # noqa: E402
from titan_exp.validation import resolve  # noqa: E402

DATA = REPO / "benchmarks" / "data"
SUITE = json.loads((DATA / "gpu_h200_suite.json").read_text())
PROFILE = MachineProfile.from_dict(json.loads((DATA / "gpu_h200_profile.json").read_text()))
# What the GPU block model does not price yet, left out of the check (named from these runs, which
# showed them 45-60 % fast: they are no held-out evidence either way). Eager float8 runs torchao's
# casts as separate kernels (2.1x the compiled step on the 1B). The MoE row ran without FSDP, so
# under autocast its routed rows stayed fp32 and took the loop over experts, a host sync a layer,
# not the grouped GEMM the model prices (titan_exp.models.moe.compute_dtype, 2026-11-26): it
# measured that fault, and waits for a GPU to be run again.
NOT_MODELLED = ("float8 tensorwise", "float8 rowwise", "MoE 8 experts top-2, bf16 + compile")


def rows(optimizer: str = "fused") -> list[dict]:
    return [r for r in SUITE["rows"] if r["optimizer"] == optimizer]


def predicted(row: dict, profile: MachineProfile) -> tuple[float, float]:
    """(step s, memory GiB) the planner predicts for one measured row."""
    name = row["config"].replace(", traced", "").replace(", warm cache", "").replace(", read every step", "")
    job = resolve(job_config([*overrides_for(row["model"], SUITE["shape"]["steps"], False), *CONFIGS[name]]))
    return predict_step(job, profile, cuda=True).step_s, predict_memory(job, cuda=True)["total"]


def test_the_calibrated_profile_is_filed_under_the_key_a_gpu_run_looks_up():
    """Calibration on the H200 wrote its profile under (nccl, 1 thread a rank): rank_key's, by
    which this_machine reads it on a GPU. (It once wrote the process group's `cuda:nccl,cpu:gloo`
    and the host's 16 threads, and every GPU run fell back to the uncalibrated defaults.)"""
    assert (PROFILE.key["backend"], PROFILE.key["threads_per_rank"]) == rank_key(True, 1)
    assert PROFILE.source == "calibrated" and PROFILE.kernels.architecture == "hopper"


def test_a_calibrated_gpu_lacks_nothing_for_a_model_it_did_not_time():
    """Its blocks are priced from their parts at its kernels' rates, so the 3B (calibrated on the
    1B) needs no calibration, for autotune or the plan; without the compiled kernels' host cost,
    a compiled job does."""
    import dataclasses

    job = resolve(job_config(overrides_for("llama3_3b", 12, False)))
    assert PROFILE.block(model_shape(job), 1) is None and PROFILE.blocks  # it timed the 1B's only
    assert PROFILE.missing(job, [1], compile=True) == []
    eager_only = dataclasses.replace(PROFILE, kernels=dataclasses.replace(PROFILE.kernels, measured=("matmul_tflops",)))
    assert eager_only.missing(job, [1], compile=True) == ["the host's cost of a compiled kernel"]
    assert eager_only.missing(job, [1], compile=False) == []


def test_the_planner_predicts_one_h200s_runs_from_its_calibrated_profile():
    """Issue 38's targets on every modelled run: tokens/s ranked with Spearman >= 0.9, median
    |error| <= 10 %; the spec sheet's errors beside them must stay larger (or the calibration is
    not what makes the fit)."""
    modelled = [r for r in rows() if r["config"] not in NOT_MODELLED]
    assert len(modelled) == 13
    measured = [r["step_s"] for r in modelled]
    calibrated = [predicted(r, PROFILE)[0] for r in modelled]
    spec = [predicted(r, spec_profile(SPECS["h200"], 1, 1))[0] for r in modelled]
    errors = [abs(p / m - 1) for p, m in zip(calibrated, measured)]
    spec_errors = [abs(p / m - 1) for p, m in zip(spec, measured)]
    assert spearman([1 / s for s in calibrated], [1 / s for s in measured]) >= 0.9
    assert statistics.median(errors) <= 0.10, errors
    assert max(errors) <= 0.20, errors
    assert statistics.median(spec_errors) > statistics.median(errors)


@pytest.mark.xfail(strict=True, reason="issue 37: memory within 10 % of the reserved peak on every run; the GPU "
                   "constants were fitted on TorchTitan's 8-GPU FSDP rows (float8 + compile +22-36 %, AC +11-36 %, "
                   "eager -13-15 % here). The eager rows are the sum of their parts (the test below); the compiled "
                   "rows' loss and blocks, selective AC and float8 + compile are not yet counted")
def test_the_planner_predicts_one_h200s_peak_memory():
    for r in rows():
        memory = predicted(r, PROFILE)[1]
        assert abs(memory / r["peak_memory_gib"] - 1) <= 0.10, (r["model"], r["config"], memory, r["peak_memory_gib"])


def saved_by_one_block(job, seq: int = 64) -> tuple[float, float]:
    """(bytes a token, bytes of weight copies) that one of this toolkit's blocks of `job`'s shape
    saves for backward under bf16 autocast, eager, counted here with autograd's saved-tensor
    hooks on a short sequence (a token's share does not depend on the sequence's length). The
    block's input and parameters, saved as they are, take no new memory; a saved tensor shaped as
    one of its weights is autocast's bf16 copy of it."""
    import torch

    from titan_exp.models.llama import TransformerBlock, rope_tables

    m = job.model
    block = TransformerBlock(m)
    cos, sin = rope_tables(m.head_size, seq, m.rope_theta)
    weights = {tuple(p.shape) for p in block.parameters()} | {tuple(p.shape[::-1]) for p in block.parameters()}
    saved: dict[int, tuple[int, bool]] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape) in weights)
        return t

    x = torch.randn(1, seq, m.dim, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    held = {t.untyped_storage().data_ptr() for t in (x, cos, sin, *block.parameters())}  # saved, not made
    made = [(n, copy) for ptr, (n, copy) in saved.items() if ptr not in held]
    return sum(n for n, copy in made if not copy) / seq, sum(n for n, copy in made if copy)


def test_one_h200s_eager_peak_memory_is_the_sum_of_its_parts():
    """Issue 37's memory target, diagnosed (2026-11-25): the H200's seven eager runs (bf16 and
    float8, 1B and 3B, either optimizer: the peak is in the backward; no FSDP, so bf16 is
    autocast's) allocated, at their peak, what these parts hold, to within 1 %, nothing fitted:
      - the parameters (fp32) and AdamW's two moments: 12 bytes a parameter (the gradients, set to
        None before the step, do not exist yet when the backward starts);
      - autocast's bf16 copies of the weights it casts, which its cache keeps from the forward
        through the backward (the backward runs inside autocast): every linear under bf16; under
        float8 the output layer's only, as torchao's linears cast their fp32 weights themselves;
      - what every block saves, counted here on this toolkit's own block (`saved_by_one_block`);
      - the eager loss at its gradient: the bf16 logits, their fp32 copy, log-softmax's saved fp32
        output and its fp32 gradient (7 units of bf16 logits).
    The memory model does not yet add them up so (the xfail above)."""
    vocab_units = 7
    eager = [r for r in SUITE["rows"] if r["config"] in ("bf16 eager", "float8 tensorwise", "float8 rowwise")]
    assert len(eager) == 7
    counted = {}
    for r in eager:
        job = resolve(job_config(overrides_for(r["model"], SUITE["shape"]["steps"], False)))
        m, tokens = job.model, SUITE["shape"]["seq_len"]
        if r["model"] not in counted:
            counted[r["model"]] = saved_by_one_block(job)
        per_token, block_copies = counted[r["model"]]
        assert block_copies == 2 * (m.block_params - 2 * m.dim)  # bf16 copies of every linear of the block
        states = 12 * m.num_params
        output_copy = 2 * m.vocab_size * m.dim  # the output layer's weight (the embedding's, where tied)
        copies = output_copy + (m.n_layers * block_copies if r["config"] == "bf16 eager" else 0)
        loss = vocab_units * tokens * m.vocab_size * 2
        parts = (states + copies + m.n_layers * tokens * per_token + loss) / 2**30
        measured = r["peak_allocated_gib"]
        assert abs(parts / measured - 1) < 0.01, (r["model"], r["config"], parts, measured)


def test_the_gpu_trace_reads_as_it_did_on_the_gpu(tmp_path):
    """titan_exp.perf.trace.gpu_summary on the bf16 + compile step traced on the H200 gives what
    it gave there: 2,790 kernels, the GPU idle ~1.4 % of the step."""
    trace = DATA / "gpu_h200_trace_llama3_3b_bf16_compile.json.gz"
    there = next(r["trace"] for r in rows() if r["model"] == "llama3_3b" and r["config"] == "bf16 + compile, traced")
    path = tmp_path / "trace.json"
    path.write_bytes(gzip.decompress(trace.read_bytes()))
    here = gpu_summary(path)
    assert here == there
    assert here["kernels"] == 2790 and here["idle_s"] / here["window_s"] < 0.02
