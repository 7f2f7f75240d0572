"""The performance model (issue 13): machine calibration's file, the model's behaviour, the refit,
the planner's output, and the autotune sweeper with profiling on a small real sweep."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SMALL, job_config, launch_cli

from titan_exp.perf.calibration import fit
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.memory_cpu import fresh_bytes
from titan_exp.perf.model.placement import across_nodes
from titan_exp.perf.model.shapes import block_tensors
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.profile import BlockCost, Line, MachineProfile, machine_key, model_shape
from titan_exp.perf.search.layouts import with_layout

TINY = ["model.n_layers=4", "training.seq_len=64"]


def synthetic(job, world: int, *, concurrency: float | None = None) -> MachineProfile:
    """A profile with round numbers: 1 ms + 2 ms per sequence per block at tp 1, halved compute
    per extra TP rank; 100 us + 1 GB/s collectives."""
    blocks = {tp: BlockCost(Line(1e-3 / tp, 1e-3 / tp), Line(1e-3 / tp, 3e-3 / tp), Line(0, 1e-3 / tp))
              for tp in (1, 2, 4, 8)}
    comm = {op: {g: Line(1e-4, 1e-9) for g in (2, 4, 8)}
            for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    comm["send_recv"] = {2: Line(5e-5, 1e-9)}
    return MachineProfile(key=machine_key("cpu", "gloo", world, 1), concurrency=concurrency or world,
                          gemm={"float32": Line(1e-5, 1e-10), "bfloat16": Line(1e-5, 0.5e-10)},
                          blocks={model_shape(job): blocks}, collectives=comm, optimizer_s_per_param=1e-9,
                          step_overhead_s=1e-3)


def layout(job, global_batch=8, **degrees):
    return with_layout(job, dict(dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1), **degrees), global_batch)


@pytest.fixture(scope="module")
def base():
    return job_config([*SMALL, *TINY, "training.local_batch_size=8"])


@pytest.mark.quick
def test_more_tp_more_tp_communication(base):
    profile = synthetic(base, 8)
    tp2 = predict_step(layout(base, tp=2, dp_shard=4), profile)
    tp4 = predict_step(layout(base, tp=4, dp_shard=2), profile)
    assert 0 < tp2.parts["tp"] < tp4.parts["tp"]
    assert "tp" not in predict_step(layout(base, dp_shard=8), profile).parts


def test_tp_collectives_carry_the_compute_dtype_and_async_tp_hides_them(base):
    """Uncalibrated TP traffic is the activations in their dtype (bf16 halves it); async TP,
    which needs a GPU, hides it behind the matmuls by the profile's overlap."""
    profile = synthetic(base, 8)
    profile = dataclasses.replace(profile, overlap=0.8, collectives={
        op: {g: Line(0.0, 1e-9) for g in groups} for op, groups in profile.collectives.items()})
    fp32 = layout(base, tp=2, dp_shard=4)
    bf16 = dataclasses.replace(fp32, precision=dataclasses.replace(fp32.precision, param_dtype="bfloat16"))
    fused = dataclasses.replace(bf16,
                                parallelism=dataclasses.replace(bf16.parallelism, enable_async_tensor_parallel=True))
    tp = {name: predict_step(job, profile, cuda=True).parts["tp"] for name, job in
          (("fp32", fp32), ("bf16", bf16), ("async", fused))}
    assert tp["bf16"] == pytest.approx(tp["fp32"] / 2, rel=0.01)  # (the loss's small fp32 all-reduces stay)
    assert tp["async"] == pytest.approx(0.2 * tp["bf16"])  # the synthetic block's compute outlasts it
    assert predict_step(fused, profile, cuda=False).parts["tp"] == pytest.approx(tp["bf16"])


def test_more_microbatches_less_bubble(base):
    profile = synthetic(base, 4)
    p = dataclasses.replace(base.parallelism, pipeline_parallel_degree=4, data_parallel_shard_degree=1)
    shares = []
    for microbatch in (8, 4, 2, 1):  # 1, 2, 4, 8 microbatches
        job = dataclasses.replace(base,
                                  parallelism=dataclasses.replace(p, pipeline_parallel_microbatch_size=microbatch),
                                  cluster=dataclasses.replace(base.cluster, nproc_per_node=4))
        step = predict_step(job, profile)
        shares.append(step.parts["bubble"] / step.step_s)
    assert shares == sorted(shares, reverse=True) and shares[-1] < shares[0] / 2
    # Zero-bubble schedules leave less of it than 1F1B.
    zb = dataclasses.replace(job, parallelism=dataclasses.replace(job.parallelism,
                                                                  pipeline_parallel_schedule="ZBVZeroBubble"))
    assert predict_step(zb, profile).parts["bubble"] < predict_step(job, profile).parts["bubble"]


def test_full_ac_recomputes(base):
    profile = synthetic(base, 2)
    none = predict_step(layout(base, dp_shard=2), profile)
    full_job = layout(dataclasses.replace(base, activation_checkpoint=dataclasses.replace(
        base.activation_checkpoint, mode="full")), dp_shard=2)
    full = predict_step(full_job, profile)
    assert none.parts["recompute"] == 0 < full.parts["recompute"]
    assert full.parts["compute"] == pytest.approx(none.parts["compute"])
    assert full.step_s > none.step_s


def test_ranks_sharing_cores(base):
    """Costs are measured with every rank computing at once. On a machine where only 2 of 4 ranks
    compute at full speed, a data-parallel step costs what was measured; a 4-stage pipeline, whose
    ranks idle in the bubble, gets back the cores they leave (on 4 GPUs it does not)."""
    gpus, shared = synthetic(base, 4), synthetic(base, 4, concurrency=2)
    fsdp, pp = layout(base, dp_shard=4), layout(base, pp=4)
    pp = dataclasses.replace(pp, parallelism=dataclasses.replace(pp.parallelism, pipeline_parallel_microbatch_size=1))
    assert predict_step(fsdp, shared).parts["compute"] == pytest.approx(predict_step(fsdp, gpus).parts["compute"])
    assert predict_step(pp, shared).parts["compute"] < 0.8 * predict_step(pp, gpus).parts["compute"]


def test_dims_across_nodes_pay_the_inter_node_costs(base):
    """On 2 nodes of 2 ranks the mesh's outer dims span nodes and its inner ones stay inside
    (tp innermost); a dim that spans nodes is costed with the profile's inter-node lines, one
    that does not with the intra-node ones, and a one-node job never with the inter-node ones."""
    two_nodes = dataclasses.replace(base, cluster=dataclasses.replace(base.cluster, nnodes=2))
    hsdp, ddp_tp = layout(two_nodes, dp_replicate=2, dp_shard=2), layout(two_nodes, dp_replicate=2, tp=2)
    assert across_nodes(hsdp) == {"dp_replicate"} and across_nodes(ddp_tp) == {"dp_replicate"}
    assert across_nodes(layout(two_nodes, dp_shard=2, tp=2)) == {"dp_shard"}
    assert across_nodes(layout(two_nodes, pp=2, cp=2)) == {"pp"}
    assert across_nodes(layout(two_nodes, tp=4)) == {"tp"}
    assert across_nodes(layout(base, dp_replicate=2, dp_shard=2)) == set()
    flat = synthetic(base, 4)
    slow = dataclasses.replace(flat, inter_node={op: {2: Line(1e-3, 1e-8)} for op in flat.collectives})
    assert predict_step(hsdp, slow).parts["hsdp"] > 5 * predict_step(hsdp, flat).parts["hsdp"]
    assert predict_step(hsdp, slow).parts["fsdp"] == pytest.approx(predict_step(hsdp, flat).parts["fsdp"])
    assert predict_step(ddp_tp, slow).parts["tp"] == pytest.approx(predict_step(ddp_tp, flat).parts["tp"])
    one_node = layout(base, dp_replicate=2, dp_shard=2)
    assert predict_step(one_node, slow).parts["hsdp"] == pytest.approx(predict_step(one_node, flat).parts["hsdp"])
    again = MachineProfile.from_dict(json.loads(json.dumps(slow.to_dict())))
    assert again.inter_node == slow.inter_node and again.collective("all_reduce", 2, True) == Line(1e-3, 1e-8)


@pytest.mark.quick
def test_fresh_memory_over_the_mmap_threshold():
    """On a CPU a step pays page faults for each tensor glibc maps afresh, those at or over
    cluster.cpu_malloc_mmap_threshold_mib: 100M's FSDP flat buffers (25 MB a block) at the
    default 16 MiB, while its weights' gradients (at most 6 MB each) fault only under a lower
    threshold; a GPU pays nothing."""
    m100 = job_config(["model=llama3_100m", "training.seq_len=256", "training.local_batch_size=4"])
    flat = sum(n * k for n, k in block_tensors(m100))
    assert 16 * 2**20 <= flat * 4 and flat * 4 / 2 < 16 * 2**20

    def fresh(threshold_mib, **degrees):
        job = layout(m100, global_batch=4, **degrees)
        job = dataclasses.replace(job,
                                  cluster=dataclasses.replace(job.cluster, cpu_malloc_mmap_threshold_mib=threshold_mib))
        return fresh_bytes(job, job.model.n_layers, True, True, accumulation=1), job

    ddp16, _ = fresh(16, dp_replicate=2)
    ddp1, _ = fresh(1, dp_replicate=2)
    fsdp16, fsdp = fresh(16, dp_shard=2)
    fsdp1, _ = fresh(1, dp_shard=2)
    assert ddp16 == 0 < ddp1 < fsdp1
    # Per block: two all-gathers' flat fp32 buffers and the reduce-scatter's flat input (its
    # output, half as large, stays under the threshold).
    assert fsdp16 == pytest.approx(m100.model.n_layers * 3 * flat * 4)
    assert fresh(None, dp_shard=2)[0] == 0  # glibc's own threshold rises to 32 MiB
    profile = dataclasses.replace(synthetic(fsdp, 2), fresh_memory_s_per_byte=1e-9)
    assert predict_step(fsdp, profile, cuda=False).parts["fresh_memory"] == pytest.approx(fsdp16 * 1e-9)
    assert "fresh_memory" not in predict_step(fsdp, profile, cuda=True).parts


@pytest.mark.quick
def test_heap_slack_under_the_mmap_threshold():
    """On a CPU the FSDP per-block buffers under the mmap threshold come from glibc's heap, which
    holds every block's flat buffers and one block's gathered weights and gradients beyond the
    live ones: the memory model's CPU allocator part. 100M (16 blocks) at FSDP 2 and 16 MiB: the
    reduce-scatter's output (a 12.6 MB half) of each block, not its 25 MB flat buffers, which are
    mapped; under TP 2 the flat buffers too; none where nothing is gathered per block. Under TP
    the heap also holds each block's sequence-sharded reduce-scatter outputs, when under the
    threshold."""
    m100 = job_config(["model=llama3_100m", "training.seq_len=256", "training.local_batch_size=4"])
    flat, blocks = sum(n * k for n, k in block_tensors(m100)) * 4, m100.model.n_layers

    def slack(threshold_mib=16, mode="default", **degrees):
        job = layout(m100, global_batch=4, **degrees)
        job = dataclasses.replace(job,
                                  cluster=dataclasses.replace(job.cluster, cpu_malloc_mmap_threshold_mib=threshold_mib),
                                  parallelism=dataclasses.replace(job.parallelism, fsdp_reshard_after_forward=mode))
        return predict_memory(job)["allocator"] * 2**30

    weights = 2 * flat  # one block's gathered weights and its unsharded gradients
    dim = m100.model.dim
    sp = 4 * blocks * 256 * dim * 4  # TP: four sequence-sharded reduce-scatter outputs a block, 2 x 256 tokens / tp 2
    assert slack(dp_shard=2) == pytest.approx(blocks * flat / 2 + weights)
    assert (slack(dp_shard=2, tp=2)
            == pytest.approx(blocks * (flat / 2 + flat / 2 + flat / 4) + weights / 2 + sp))  # 12.6 MB
    assert slack(tp=2) == pytest.approx(2 * sp)  # 4 x 256 tokens / tp 2: 1.5 MiB outputs, under 16 MiB
    assert slack(tp=4) == pytest.approx(sp)
    assert slack(1, tp=2) == 0  # mapped at 1 MiB
    assert slack(None, dp_shard=2) == pytest.approx(blocks * (flat + flat + flat / 2) + weights)  # glibc's own: 32 MiB
    assert 0 < slack(1, dp_shard=2) < 0.1 * slack(dp_shard=2)  # only the K and V weights (0.8 MB) stay in the heap
    assert slack(dp_shard=4) == pytest.approx(blocks * flat / 4 + weights)  # a smaller shard returned
    for none in (slack(dp_replicate=2), slack(pp=2, dp_shard=2), slack(dp_shard=2, mode="never")):
        assert none == 0
    assert predict_memory(layout(m100, global_batch=4, dp_shard=2), cuda=True)["allocator"] == 0  # a GPU: no heap


def test_a_measured_fsdp_block_replaces_the_lines(base):
    """Where calibration measured a real FSDP block at the shard degree, each block costs what it
    added, scaled by the collectives' lines to the job's gathers and dtype; its fresh buffers are
    in that cost, not counted again; other shard degrees and TP keep the lines."""
    plain = synthetic(base, 4)
    cost = plain.blocks[model_shape(base)][1]
    extra = Line(0.05, 0.0)
    measured = dataclasses.replace(plain, fresh_memory_s_per_byte=1e-9, blocks={model_shape(base): {
        **plain.blocks[model_shape(base)], 1: dataclasses.replace(cost, fsdp_extra={2: extra})}})
    plain = dataclasses.replace(plain, fresh_memory_s_per_byte=1e-9)
    m, ag, rs = base.model, plain.collective("all_gather", 2), plain.collective("reduce_scatter", 2)
    lines = 2 * ag(m.block_params * 4) + rs(m.block_params * 4)  # two fp32 all-gathers and a reduce-scatter

    def fsdp(job, profile):
        return predict_step(job, profile, cuda=False).parts["fsdp"]

    job = layout(base, dp_shard=2)
    assert fsdp(job, measured) - fsdp(job, plain) == pytest.approx(m.n_layers * (0.05 - lines))
    every_buffer = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, cpu_malloc_mmap_threshold_mib=0))
    ends = fresh_bytes(every_buffer, 0, True, True, 1)  # the embedding's and output's buffers only
    assert predict_step(every_buffer, measured, cuda=False).parts["fresh_memory"] == pytest.approx(ends * 1e-9)
    assert predict_step(every_buffer, plain, cuda=False).parts["fresh_memory"] > ends * 1e-9
    # Once-gathered parameters (reshard_after_forward=never): the measured cost scaled by the lines.
    never = dataclasses.replace(job,
                                parallelism=dataclasses.replace(job.parallelism, fsdp_reshard_after_forward="never"))
    once = ag(m.block_params * 4) + rs(m.block_params * 4)
    assert fsdp(never, measured) - fsdp(never, plain) == pytest.approx(m.n_layers * (0.05 * once / lines - once))
    for other in (layout(base, dp_shard=4), layout(base, dp_shard=2, tp=2)):  # not measured: the lines
        assert fsdp(other, measured) == pytest.approx(fsdp(other, plain))


@pytest.mark.quick
@pytest.mark.parametrize("model", ["debugmodel", "moe_debug"])
def test_what_a_real_tp_block_adds_is_counted_against_the_block_it_computes(model, monkeypatch):
    """Calibration's TP cost is the real TP block less the plain sharded block it computes. An MoE
    block's plain measurement holds its routed experts whole (measure_compute.sharded_block), where
    a real TP rank runs 1/tp of their work (its slice of each expert's width): the plain block is
    taken at that share of its FLOPs, as the step model takes it, so the two add up to the real
    block. (Subtracting the whole block left nothing: the real TP block was the faster.)"""
    from titan_exp.perf.calibration import measure

    m = job_config([f"model={model}", "training.seq_len=64"]).model
    plain, real = Line(1e-3, 4e-3), Line(2e-3, 5e-3)  # (latency, per sequence): fwd + bwd
    monkeypatch.setattr(measure, "measure_compute", lambda *a: (
        {1: (plain, plain), 2: (plain, plain)},
        {1: (plain, Line(3e-3, 6e-3), None), 2: (real, Line(3e-3, 6e-3), None)}, 1.0))
    monkeypatch.setattr(measure, "measure_cp_blocks", lambda *a: {})
    monkeypatch.setattr(measure, "measure_fsdp_blocks", lambda *a: {})
    profile = synthetic(job_config([f"model={model}"]), 2)
    measure._measure_blocks(profile, "shape", m, 64, 2, None, None)
    share = m.measured_block_share(2)
    assert (share == 1) == (model == "debugmodel")
    tp_comm = profile.blocks["shape"][2].tp_comm
    assert (tp_comm.latency_s, tp_comm.per_unit_s) == pytest.approx((2e-3 - 1e-3 * share, 5e-3 - 4e-3 * share))


def test_a_measured_tp_optimizer_phase_replaces_the_per_parameter_cost(base):
    """Under TP the optimizer phase is the calibrated real TP model's, by the rank's blocks and its
    share of the rest (a pipeline stage without the embedding or the output pays none of theirs);
    without TP, or at a TP degree with no measurement, AdamW's cost per local parameter."""
    plain = synthetic(base, 8)
    by_tp = plain.blocks[model_shape(base)]
    measured = dataclasses.replace(plain, blocks={model_shape(base): {
        **by_tp, 2: dataclasses.replace(by_tp[2], update=Line(0.2, 0.05))}})

    def optimizer(job, profile):
        return predict_step(job, profile).parts["optimizer"]

    n = base.model.n_layers
    assert optimizer(layout(base, tp=2, dp_shard=4), measured) == pytest.approx(0.2 + 0.05 * n)
    # pp 2 over 4 layers: each stage holds 2 blocks and one of the embedding and the output.
    assert optimizer(layout(base, pp=2, tp=2, dp_shard=2), measured) == pytest.approx(0.1 + 0.05 * n / 2)
    for other in (layout(base, dp_shard=8), layout(base, tp=4, dp_shard=2)):
        assert optimizer(other, measured) == pytest.approx(optimizer(other, plain)) and optimizer(other, plain) < 0.01
    assert optimizer(layout(base, tp=2, dp_shard=4), plain) < 0.01


@pytest.mark.quick
def test_refit_recovers_a_scale(base):
    profile = synthetic(base, 4)
    jobs = [layout(base, dp_shard=4), layout(base, dp_replicate=4), layout(base, tp=2, dp_shard=2), layout(base, pp=4),
            layout(base, dp_shard=2, cp=2)]
    runs = [(predict_step(j, profile), 1.7 * predict_step(j, profile).step_s) for j in jobs]
    fitted = fit.refit(profile, runs)
    assert fitted.corrections.median_error_before == pytest.approx(0.7 / 1.7, rel=1e-6)
    assert fitted.corrections.median_error_after < 0.01
    again = [predict_step(j, fitted).step_s for j in jobs]
    assert again == pytest.approx([m for _, m in runs], rel=0.02)
    assert fit.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert fit.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    rate, low, high = fit.throughput_interval([1.0, 1.1, 0.9, 1.0], 1000, 2)
    assert rate == pytest.approx(500) and low < rate < high


@pytest.mark.quick
def test_measurements_compared_are_timed_in_the_same_rounds():
    """perf.calibration.timing.side_by_side: every Runs' fns are timed in each round before the next round
    starts (a block and the real model's block, compared, then see the same spell of the
    machine), and each Runs gets back its own columns, round by round."""
    import torch
    import torch.distributed as dist

    from titan_exp.perf.calibration import timing

    calls: list[str] = []

    def runs(name: str, n: int) -> timing.Runs:
        return timing.Runs([lambda i=i: calls.append(f"{name}{i}") for i in range(n)], lambda times: times)

    groups = [runs("a", 2), runs("b", 1), runs("c", 3)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        times = timing.side_by_side(groups, timing.Options(), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    per_call = 1 + timing.Options().reps // 3  # a warm-up and the timed calls
    one_round = [f"{name}{i}" for name, n in (("a", 2), ("b", 1), ("c", 3)) for i in range(n) for _ in range(per_call)]
    assert calls == one_round * timing.ROUNDS
    assert [[len(row) for row in t] for t in times] == [[n] * timing.ROUNDS for n in (2, 1, 3)]


def test_calibration_profile_file(tmp_path):
    """A real 2-rank calibration writes the profile (every part the model reads, with sane
    values); a second run reuses it without starting ranks; --refresh measures again."""
    args = [sys.executable, "-m", "titan_exp.perf.calibrate", *TINY, "--world", "2", "--tiny", "--profile-dir",
            str(tmp_path)]
    first = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    (path,) = tmp_path.glob("*-w2-*.json")
    data = json.loads(path.read_text())
    assert data["format"] == 1 and data["source"] == "calibrated" and data["key"]["world"] == 2
    profile = MachineProfile.from_dict(data)
    shape = model_shape(job_config(TINY))
    assert set(profile.blocks[shape]) == {1, 2}  # every TP degree 2 ranks allow
    for tp, cost in profile.blocks[shape].items():  # tiny sizes are noisy: only what noise cannot flip
        assert cost.fwd_bwd(2) > cost.fwd(2) > 0 and cost.head(2) >= 0
        assert (cost.tp_comm is not None) == (tp > 1) and (cost.update is not None) == (tp > 1)
    assert profile.blocks[shape][2].update(1) > 0 and "optimizer phase" in first.stdout
    assert set(profile.blocks[shape][1].cp_extra) == {2} and set(profile.blocks[shape][1].fsdp_extra) == {2}
    assert not profile.blocks[shape][2].fsdp_extra  # measured at tp 1 only
    assert {"float32", "bfloat16"} <= set(profile.gemm) and all(r[3] > 0 for r in profile.gemm_shapes["float32"])
    assert set(profile.collectives) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv"}
    assert all(line(1 << 20) > 0 for by_g in profile.collectives.values() for line in by_g.values())
    assert 1.0 <= profile.concurrency <= 2.0 and 0.0 <= profile.overlap <= 1.0 and profile.optimizer_s_per_param > 0
    assert profile.fresh_memory_s_per_byte > 0 and "fresh pages" in first.stdout
    assert "block tp=2" in first.stdout and "all_gather: 2 ranks" in first.stdout
    kernels = profile.kernels  # what a GPU's plan prices unmeasured blocks at (issue 36, part 5); a CPU's are kept
    assert kernels.source == "calibrated" and kernels.architecture == "cpu"
    assert kernels.head_dim == job_config(TINY).model.head_size
    assert set(kernels.matmul_tflops) == {"float32", "bfloat16"} and min(kernels.matmul_tflops.values()) > 0
    assert [s for s, _ in kernels.attention_fwd] == [64, 128] and all(r > 0 for _, r in kernels.attention_bwd)
    assert kernels.memory_tb_s > 0 and kernels.host_eager_s > 0 and "host_compiled_s" not in kernels.measured
    assert "grouped_gemm_share" in kernels.measured and kernels.grouped_gemm_share > 0  # torch._grouped_mm runs on CPU
    assert kernels.attention_kernel in ("flash", "math") and f"attention ({kernels.attention_kernel})" in first.stdout
    assert "kernels: matmul TFLOP/s" in first.stdout and "compiled kernel not measured" in first.stdout
    assert "of the dense rate" in first.stdout
    # the block's own memory-bound ops, eager (compiled only with --compile)
    assert "elementwise_tb_s" in kernels.measured and list(kernels.elementwise_tb_s) == ["eager"]
    assert kernels.elementwise_tb_s["eager"] > 0 and "the block's eager" in first.stdout
    # torchao's Python around an eager float8 linear ([torchao-eager]): its float8 matmul runs on CPU
    assert "host_float8_s" in kernels.measured and kernels.host_float8_s > 0
    assert "ms/eager float8 linear" in first.stdout
    again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "reusing" in again.stdout and json.loads(path.read_text()) == data
    refreshed = subprocess.run([*args, "--refresh"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refreshed.returncode == 0 and json.loads(path.read_text())["created"] >= data["created"]
    assert json.loads(path.read_text())["calibration_s"] != data["calibration_s"]


def test_plan_prints_times_and_the_profile(tmp_path):
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *TINY, "autotune.calibrate=false",
                          "--world", "4", "--profile-dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rates: FLOPs estimates, nothing measured (autotune.calibrate=false), for this machine" in out.stdout
    assert "| step s | tokens/s/device |" in out.stdout


@pytest.mark.quick
def test_the_grid_estimate_prices_compile_from_compiled_members(base):
    """Autotune's estimate of the whole grid's machine time takes each candidate's start-up from
    the measured members compiled alike: a compiled member's compile is not an eager member's."""
    from titan_exp.config import AutotuneAxis
    from titan_exp.perf.autotune import Autotune, Member, candidates
    from titan_exp.perf.rates.accuracy import Check

    job = dataclasses.replace(base, autotune=dataclasses.replace(base.autotune,
                                                                 search=[AutotuneAxis.layout, AutotuneAxis.compile]))
    profile = synthetic(base, 2)
    grid = candidates(job, 2, cuda=False, profile=profile, memory_gib=1e9)
    eager = [c for c in grid if not c.job.compile.enable]
    compiled = [c for c in grid if c.job.compile.enable]
    assert len(eager) == len(compiled) >= 2
    a = job.autotune
    # Two eager members measured and one compiled, exactly as predicted: a mean over all three
    # (10 s) would price the grid differently.
    for c, start in ((eager[0], 5.0), (eager[1], 5.0), (compiled[0], 20.0)):
        steps = [c.predicted_step_s] * a.steps
        c.members.append(Member(0, "run", "ok", steps, wall_s=start + sum(steps)))
    tune = Autotune(job, [], launch=lambda batch: [], sweep_dir=Path("."), cuda=False, profile=profile)
    tune.tokens_per_step = job.training.global_batch_size * job.training.seq_len  # as run() sets it
    record = tune._record(grid, None, "done", 60.0, Check(0.1, "then", "here"))
    steps = sum((a.warmup_steps + a.steps) * c.predicted_step_s for c in grid)
    assert record["grid"]["estimated_s"] == pytest.approx(steps + 5.0 * len(eager) + 20.0 * len(compiled))


def test_a_trace_counts_the_waits_for_collectives_and_transfers(tmp_path):
    """A traced step's communication is where it waited: DTensor's functional collectives are
    waited for in `_c10d_functional::wait_tensor` and a gloo send or receive in `gloo:send` /
    `gloo:recv`, not in the c10d op that started them (a pp4 x tp2 step on 8 gloo ranks spent
    1.4 s of 3.2 in the former and 1.0 s in the latter, 0.1 s in c10d ops). Events on other
    threads (gloo's own) are not the step's."""
    from titan_exp.train.trace import step_breakdown

    def op(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}

    events = [op("ProfilerStep#5", 0, 10_000, cat="user_annotation"),
              op("c10d::allgather_into_tensor_coalesced_", 1_000, 100),
              op("_c10d_functional::wait_tensor", 2_000, 2_000),
              op("_c10d_functional::wait_tensor", 3_000, 500),  # overlapping: counted once
              op("c10d::send", 5_000, 50), op("gloo:send", 5_050, 1_450, cat="user_annotation"),
              op("gloo:recv", 7_000, 1_000, cat="user_annotation"),
              op("gloo:all_reduce", 0, 9_000, tid=2, cat="user_annotation"),
              op("aten::mm", 8_500, 1_000)]
    trace = tmp_path / "rank0_trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    parts = step_breakdown(trace)
    assert parts["exposed_comm"] == pytest.approx(0.0021)
    assert parts["p2p_and_bubble"] == pytest.approx(0.0025)
    assert parts["compute"] == pytest.approx(0.0054) and parts["step_s"] == pytest.approx(0.010)


def test_autotune_sweep(tmp_path, titan_cache):
    """A real autotune sweep on 2 ranks: the memory model prunes, the first round measures top_k
    members, later rounds those whose measured interval reaches the fastest's, with twice the
    steps, until one is left or the budget stops it; profiling writes traces whose breakdown
    reaches the report, the record says what happened, and the profile is refit."""
    from titan_exp.perf.autotune import candidates
    from titan_exp.perf.rates.profile import this_machine
    from titan_exp.perf.search.layouts import batch_splits, factorizations

    overrides = [*SMALL, *TINY, "training.local_batch_size=4", "cluster.nproc_per_node=2"]
    job = job_config(overrides)
    grid = candidates(job, 2, cuda=False, profile=this_machine(2), memory_gib=1e9)
    # Every layout runs at a split that fits where one does: memory prunes the layout whose
    # every split needs more than the most frugal layout's.
    least = [min(predict_memory(j)["total"] for j in splits)
             for splits in (batch_splits(job, d, 8) for d in factorizations(2)) if splits]
    largest = max(least)
    assert len(grid) >= 4 and largest > min(least)
    sweep = tmp_path / "sweep"
    result = launch_cli(["-m", "+sweep=autotune", *overrides, f"hydra.sweep.dir={sweep}", "autotune.top_k=3",
                         "autotune.steps=2", "autotune.warmup_steps=1", f"autotune.device_memory_gib={largest - 1e-3}",
                         "autotune.calibrate=false", "autotune.budget_minutes=2",
                         "autotune.drop_slower_than=0",  # intervals only: a noisy member is not dropped early
                         "profiling.enable_profiling=true", "profiling.profile_freq=2",
                         "profiling.enable_memory_snapshot=true"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((sweep / "autotune.json").read_text())
    counts = [len(r["members"]) for r in record["rounds"]]
    assert counts[0] == 3 and counts == sorted(counts, reverse=True)
    assert all(r["timed_steps"] == 2 * q["timed_steps"] for q, r in zip(record["rounds"], record["rounds"][1:]))
    assert record["stopped"].startswith(("budget", "no other candidate may be more than 2% faster"))
    by_name = {c["name"]: c for c in record["candidates"]}
    assert any(c["pruned"].startswith("memory model") for c in by_name.values())
    assert sum("outside the 3 measured (top_k)" in c["pruned"] for c in by_name.values()) == record["grid"]["fit"] - 3
    winner = record["winner"]
    low, high = winner["interval"]
    assert len(winner["members"]) == len(counts) and low <= winner["measured_tokens_per_s"] <= high
    for c in by_name.values():  # every measured loser says when and why it stopped
        if c["members"] and c is not by_name[winner["name"]]:
            assert c["pruned"].startswith(("round ", "measured slower than the winner")), c
    assert 0 < record["spent_s"] and 0 < record["grid"]["estimated_s"]  # the ratio is benchmarks/bench_autotune.py's
    # Every member is an ordinary run dir with traces; the report has the autotune section and the
    # trace's breakdown.
    members = sorted(p for p in sweep.iterdir() if (p / ".hydra").is_dir())
    assert len(members) == sum(counts)
    assert all(len(list((m / "profile_traces").glob("iteration_2/rank*_trace.json"))) == 2 for m in members)
    phases = json.loads((members[0] / "memory_snapshot" / "rank1_memory_phases.json").read_text())
    assert [(p["step"], p["phase"]) for p in phases] == [(1, "forward_backward"), (1, "optimizer"),
                                                         (2, "forward_backward"), (2, "optimizer"),
                                                         (3, "forward_backward"), (3, "optimizer")]
    assert all(p["rss_gib"] > 0 for p in phases)
    assert [p["peak_rss_gib"] for p in phases] == sorted(p["peak_rss_gib"] for p in phases)  # a peak never falls
    overrides_1 = yaml.safe_load((members[0] / ".hydra" / "overrides.yaml").read_text())
    assert "training.steps=3" in overrides_1 and "metrics.warmup_steps=1" in overrides_1
    report = (sweep / "report.md").read_text()
    assert "## Autotune" in report and f"**Winner: {winner['name']}**" in report
    import csv

    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert all(r["breakdown_source"].startswith("trace") for r in rows)
    assert all(float(r["predicted_tokens_per_second_per_device"]) > 0 and r["prediction_error"] for r in rows)
    refit = json.loads(open(record["refit"]["profile"]).read())  # one run per measured candidate
    assert record["refit"]["measurements"] == refit["corrections"]["measurements"] == 3
