"""The layout planner: enumeration against brute force, the memory model's arithmetic, the CLI
and the sweep preset it writes. Its accuracy against measured memory is in BENCHMARKS.md
(benchmarks/bench_plan.py)."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, compose, job_config
from titan_exp.parallel.pipeline import layer_split, rank_loads
from titan_exp.perf import planner
from titan_exp.perf.devices import SPEC_ACCURACY, SPECS, spec_profile
from titan_exp.perf.memory import AS_COUNTED, GpuMemory, predict_memory
from titan_exp.perf.step import predict_step
from titan_exp.validation import resolve, validate

BASE = ["model=llama3_100m", "training.seq_len=256", "training.local_batch_size=2", "training.global_batch_size=8"]


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8])
@pytest.mark.quick
def test_enumeration_is_every_valid_layout(world):
    """Brute force: every 5-tuple of degrees in 1..world, kept if its product is the world and
    the validator accepts it. The planner must find exactly those."""
    job = job_config(BASE)
    brute = set()
    for degrees in itertools.product(range(1, world + 1), repeat=5):
        if math.prod(degrees) != world:
            continue
        candidate = planner.with_layout(job, dict(zip(planner.MESH_DIMS, degrees)), 8)
        if not validate(candidate, cuda=False):
            brute.add(degrees)
    found = {tuple(planner.degrees_of(j).values()) for j in planner.valid_layouts(job, world)}
    assert found == brute
    assert len(found) >= {1: 1, 2: 4, 4: 10, 6: 0, 8: 10}[world]  # 6 ranks: nothing divides heads and batch


@pytest.mark.quick
def test_memory_model_shards_states_and_ranks_by_fit():
    job = job_config(BASE)
    single = planner.predict_memory(planner.with_layout(job, dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1), 8))
    for n in (2, 4, 8):
        fsdp = planner.predict_memory(planner.with_layout(job, dict(pp=1, dp_replicate=1, dp_shard=n, cp=1, tp=1), 8))
        assert fsdp["states"] == pytest.approx(single["states"] / n)
    ddp = planner.predict_memory(planner.with_layout(job, dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=1), 8))
    assert ddp["states"] == pytest.approx(single["states"])
    full_ac = planner.predict_memory(job_config([*BASE, "activation_checkpoint.mode=full"]))
    assert full_ac["activations"] + full_ac["checkpoints"] < single["activations"] / 4
    plans = planner.plan(job, 4, device_memory_gib=1.2)  # DDP 4 (whole states per rank) cannot fit
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True) and True in fits and False in fits
    assert not next(p for p in plans if p.degrees["dp_replicate"] == 4).fits


def test_memory_model_counts_what_grows_at_scale():
    """The terms that TorchTitan's published runs and the dry run at 64-512 ranks showed the
    model had missed (BENCHMARKS.md), on the 8B shape on a GPU: a 128k vocabulary makes the
    embedding and output larger FSDP units than a block; sequence parallel's gathered inputs are
    whole on every TP rank, and so is the TP embedding's gradient; a pipeline keeps each
    microbatch's checkpoints but recomputes one block at a time, and accumulates unsharded
    gradients over several microbatches; a GPU adds GpuMemory's terms; the logits are split by
    TP only under loss parallel."""
    gib = 2**30
    job = job_config(["model=llama3_8b", "training.seq_len=8192", "training.local_batch_size=1",
                      "precision=bf16", "activation_checkpoint.mode=full"])
    m = job.model

    def memory(global_batch=8, job=job, **degrees):
        layout = dict(dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1), **degrees)
        return planner.predict_memory(planner.with_layout(job, layout, global_batch), cuda=True, gpu=AS_COUNTED)

    fsdp = memory(dp_shard=8)
    assert m.embedding_params > 2 * m.block_params
    assert fsdp["fsdp_working_set"] == pytest.approx((2 * m.output_params + m.block_params) * 2 / gib)  # output: + norm

    tokens = 8192  # one sequence per rank in both layouts
    tp = memory(global_batch=1, tp=8)
    gathered = 2 * tokens * m.dim * 2 * (1 - 1 / 8) / gib  # attention's and feed-forward's inputs, bf16
    assert tp["activations"] == pytest.approx(fsdp["activations"] / 8 + gathered)
    assert tp["checkpoints"] == pytest.approx(fsdp["checkpoints"] / 8)  # block inputs stay sequence-sharded
    # DTensor computes the TP embedding's gradient whole (vocab x dim) before keeping the shard.
    assert tp["fsdp_working_set"] == pytest.approx(m.embedding_params * 2 * (1 + 2 / 8) / gib)

    pipeline = job_config(["model=llama3_8b", "training.seq_len=8192", "training.local_batch_size=8", "precision=bf16",
                           "activation_checkpoint.mode=full", "parallelism.pipeline_parallel_microbatch_size=1"])
    one, eight = (memory(global_batch=n, job=pipeline, pp=4, dp_shard=2) for n in (2, 16))  # 1 and 8 microbatches
    assert eight["checkpoints"] == pytest.approx(4 * one["checkpoints"])  # 1F1B: 4 of the 8 microbatches alive
    assert eight["activations"] == pytest.approx(one["activations"])  # one block recomputed at a time
    # Over several microbatches the stage's unsharded fp32 gradients accumulate, on any device.
    for cuda in (True, False):
        single, several = (planner.predict_memory(planner.with_layout(pipeline, dict(
            pp=4, dp_replicate=1, dp_shard=2, cp=1, tp=1), n), cuda=cuda) for n in (2, 16))
        assert several["fsdp_working_set"] > single["fsdp_working_set"] * 1.5

    # On a GPU the kernels keep a share of the CPU-fitted activation count and the caching
    # allocator's fragmentation grows what comes and goes (GpuMemory, fitted on TorchTitan's 8B rows).
    gpu, layout = GpuMemory(), planner.with_layout(job, dict(pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=1), 8)
    on_gpu, on_cpu = planner.predict_memory(layout, cuda=True), planner.predict_memory(layout)
    assert on_gpu["states"] == fsdp["states"] and on_gpu["checkpoints"] == fsdp["checkpoints"]
    assert on_gpu["activations"] == pytest.approx(fsdp["activations"] * gpu.activation_scale)
    assert on_gpu["allocator"] == pytest.approx(
        gpu.fragmentation * (on_gpu["activations"] + fsdp["checkpoints"] + fsdp["logits"] + on_gpu["float8"]))
    # A CPU's slack is glibc's heap, not GpuMemory's (tests/test_perf.py::test_heap_slack_under_the_mmap_threshold).
    assert on_cpu["allocator"] == planner.predict_memory(layout, gpu=AS_COUNTED)["allocator"] < on_gpu["allocator"]

    no_loss_parallel = planner.predict_memory(planner.with_layout(
        job_config(["model=llama3_8b", "training.seq_len=8192", "training.local_batch_size=1", "precision=bf16",
                    "parallelism.disable_loss_parallel=true"]), dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=8), 1),
        cuda=True, gpu=AS_COUNTED)
    assert no_loss_parallel["logits"] > 7 * tp["logits"]


def test_cli_prints_the_ranking_and_writes_a_sweep(tmp_path, monkeypatch):
    proc = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *BASE, "--world", "4", "autotune.calibrate=false",
                           "--top", "3",  # an override after a flag is read as one too
                           "--device-memory-gib", "8"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "valid layouts on 4 devices" in proc.stdout and "| 1 |" in proc.stdout
    job = job_config(BASE)
    plans = planner.plan(job, 4, device_memory_gib=8)
    monkeypatch.setenv("TITAN_EXP_SWEEPS", str(tmp_path))  # the user's sweeps/, never the package
    out = planner.write_sweep(plans, "p4", 3, BASE)
    assert out == tmp_path / "p4.yaml"
    preset = yaml.safe_load(out.read_text())
    choices = preset["hydra"]["sweeper"]["params"]["+plan_layout"].split(",")
    assert choices == ["p4_0", "p4_1", "p4_2"]
    # Registered like the package's named sweeps, the written layouts compose into valid jobs.
    from titan_exp.config import register_configs

    register_configs()
    assert compose(["+sweep=p4"], with_hydra=True).hydra.sweeper.params["+plan_layout"] == "p4_0,p4_1,p4_2"
    for choice, expected in zip(choices, plans):
        job = job_config([*BASE, f"+plan_layout={choice}"])
        assert job.parallelism.tensor_parallel_degree == expected.degrees["tp"]
        assert job.parallelism.pipeline_parallel_degree == expected.degrees["pp"]
        assert job.cluster.nproc_per_node == 4 and not validate(job, cuda=False)
    two = [*BASE, "cluster.nnodes=2", "cluster.nproc_per_node=2"]  # a layout over 2 nodes: 2 ranks on each
    planner.write_sweep(planner.plan(job_config(two), 4, device_memory_gib=8), "p4n2", 1, two)
    job = job_config([*two, "+plan_layout=p4n2_0"])
    assert (job.cluster.nnodes, job.cluster.nproc_per_node, job.world_size) == (2, 2, 4)


@pytest.mark.quick
def test_the_plan_compares_layouts_at_the_configured_batch_and_places_the_configured_one():
    """With no global batch set, every layout is compared at the batch the job would run: its local
    batch on each data-parallel rank of its configured layout (as `resolve` fills it for a launch),
    not on every rank, which for TorchTitan's 70B (FSDP 32 x TP 8, local batch 16) had been 4,096
    sequences where TorchTitan ran 512 (issue 36). The job as configured is shown beside the plans:
    its prediction, and where its layout ranks; refused, the refusal."""
    tp = ["model=llama3_8b", "training.seq_len=2048", "training.local_batch_size=4", "parallelism=fsdp",
          "parallelism.tensor_parallel_degree=4", "cluster=slurm", "cluster.nnodes=2", "cluster.nproc_per_node=8"]
    job, profile = job_config(tp), spec_profile(SPECS["h100"], 16, 8)
    assert planner.global_batch_of(job, 16) == resolve(job).training.global_batch_size == 4 * 4
    plans = planner.plan(job, 16, device_memory_gib=80, cuda=True, profile=profile, any_split=True)
    assert next(pl for pl in plans if pl.degrees["dp_shard"] == 16).split == "local batch 1"  # 16 sequences on 16
    rank = 1 + next(i for i, pl in enumerate(plans) if pl.degrees == dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=4))
    tokens = predict_step(resolve(job), profile, cuda=True).tokens_per_s_per_device
    line = planner.configured_line(job, 16, plans, profile, device_memory_gib=80, cuda=True)
    assert line.startswith(f"your configuration (dp_shard4 x tp4, local batch 4): {tokens:,.0f} tokens/s/device, ")
    assert f"its layout ranks {rank} of {len(plans)};" in line and rank > 1
    assert line.endswith(f"the fastest, {plans[0].name} ({plans[0].split}), is predicted "
                         f"{plans[0].tokens_per_s / tokens - 1:+.0%}")
    small = planner.plan(job, 16, device_memory_gib=30, cuda=True, profile=profile, any_split=True)
    cramped = planner.configured_line(job, 16, small, profile, device_memory_gib=30, cuda=True)
    assert "GiB/device (does NOT fit)" in cramped and cramped.endswith(  # what fits beside it, not a percentage
        f"the fastest that fits, {small[0].name} ({small[0].split}), {small[0].tokens_per_s:,.0f} tokens/s/device")
    refused = job_config([*tp, "parallelism.tensor_parallel_degree=16"])
    assert planner.configured_line(refused, 16, plans, profile, device_memory_gib=80, cuda=True) == (
        "your configuration (tp16, local batch 4) is refused on 16 devices: parallelism.tensor_parallel_degree = 16: "
        "does not divide model.n_kv_heads = 8; pick a degree that does")
    other = job_config([*tp, "parallelism.tensor_parallel_degree=3"])  # not a layout of 16: each rank's local batch
    assert planner.global_batch_of(other, 16) == 64 and planner.configured_line(other, 16, plans, profile,
                                                                               device_memory_gib=80, cuda=True) is None
    assert planner.batch_line(other, 16) == ("every layout at a global batch of 64 sequences (training.local_batch_size "
                                             "4 on each of the 16 devices: the configured degrees (tp3) do not "
                                             "multiply to 16)")
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *tp[:-3], "--device", "h100", "--world", "16"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("every layout at a global batch of 16 sequences (training.local_batch_size 4 x 4 data-parallel ranks of "
            "the configured layout, dp_shard4 x tp4)") in out.stdout.splitlines()
    assert out.stdout.splitlines()[-1] == line


@pytest.mark.quick
def test_a_plan_near_the_memory_limit_says_so_and_names_one_with_the_memory_models_margin():
    """On GPUs the fastest plan that fits can sit closer to the device's memory than the memory
    model's worst error on held-out published runs (SPEC_ACCURACY's memory; the CUDA context is
    not counted either): the plan then says so and names the fastest layout with that margin."""
    job = job_config(["model=llama3_8b", "training.seq_len=8192", "training.global_batch_size=32",
                      "cluster=slurm", "cluster.nnodes=2", "cluster.nproc_per_node=8"])
    profile = spec_profile(SPECS["h100"], 16, 8)
    roomy = planner.plan(job, 16, device_memory_gib=80, cuda=True, profile=profile, any_split=True)
    _, _, worst = SPEC_ACCURACY["memory"]
    assert 0 < worst < 0.25
    best = roomy[0]
    assert planner.margin_line(roomy, best.memory_gib / (1 - worst) * 1.01) is None  # a margin wider than the worst
    device = best.memory_gib / (1 - worst / 2)  # the best fits, inside the worst error of the limit
    tight = planner.plan(job, 16, device_memory_gib=device, cuda=True, profile=profile, any_split=True)
    assert tight[0].name == best.name and tight[0].fits
    safe = next(pl for pl in tight if pl.memory_gib <= (1 - worst) * device)
    assert safe.name != best.name
    line = planner.margin_line(tight, device)
    assert line.startswith(f"{best.name} ({best.split}) is predicted at {best.memory_gib:.2f} of {device:.2f} "
                           f"GiB/device, closer to the limit than the memory model's worst error")
    assert line.endswith(f"the fastest under {(1 - worst) * device:.2f} GiB, {safe.name} ({safe.split}), "
                         f"{safe.tokens_per_s:,.0f} tokens/s/device ({safe.tokens_per_s / best.tokens_per_s - 1:+.0%})")


# --- planning GPUs this machine does not have (spec sheets) ---------------------------------------

def test_spec_profile_follows_the_sheet_and_a_calibrated_one_wins(tmp_path):
    """A spec profile's costs come from its sheet (ring collectives over NVLink inside a node, over
    the NIC across nodes); a profile calibrated on that GPU, where one exists, replaces it."""
    import json

    from titan_exp.perf.devices import SPECS, Efficiency, profile_for, spec_profile
    from titan_exp.perf.profile import MachineProfile, machine_key

    h100, eff = SPECS["h100"], Efficiency()
    profile = spec_profile(h100, 64, 8, eff)
    assert profile.source == "spec" and profile.key["nodes"] == 8 and profile.kernels.source == "spec"
    assert profile.corrections.compute == eff.compute_scale
    assert profile.gemm["bfloat16"].per_unit_s == pytest.approx(1 / (989.4e12 * 794.5 / 989))  # [mamf]'s bf16 share
    assert profile.gemm["float8"].per_unit_s == pytest.approx(1 / (1978.9e12 * 1402.6 / 1979))  # and its float8 one
    nvlink = profile.collective("all_reduce", 8)
    assert nvlink.per_unit_s == pytest.approx(2 * 7 / 8 / (450e9 * eff.nvlink))
    across = profile.collective("all_reduce", 8, across_nodes=True)
    assert across.per_unit_s == pytest.approx(2 * 7 / 8 / (50e9 * eff.network)) and across(1e9) > 5 * nvlink(1e9)
    assert "float8" not in spec_profile(SPECS["a100"], 8, 8).gemm  # no FP8 tensor cores
    assert profile_for("h100", 16, 8, tmp_path).source == "spec"
    measured = MachineProfile(key=machine_key("NVIDIA H100 80GB HBM3", "nccl", 16, 1, 2), created="then")
    measured.save(tmp_path)
    assert profile_for("h100", 16, 8, tmp_path).created == "then"
    assert json.loads(measured.path(tmp_path).read_text())["key"]["nodes"] == 2


def test_plan_a_512_gpu_cluster_from_a_spec_sheet():
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "model=llama3_8b", "training.seq_len=8192",
                          "training.local_batch_size=2", "--device", "h100", "--world", "512", "--gpus-per-node", "8",
                          "--top", "0"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("times PREDICTED FROM A SPEC SHEET (from the spec sheet of h100")
    runs, signed, size = SPEC_ACCURACY["by_device"]["h100"]  # its own accuracy on published runs, after the whole's
    assert (f"on h100's sheet alone ({runs} runs) {size:.0%} at the median, the median run predicted "
            f"{abs(signed):.0%} too {'slow' if signed < 0 else 'fast'}; calibrate") in out.stdout.splitlines()[0]
    # H100 80GB's memory as its driver shows it (81,559 MiB), not 80e9 bytes (74.5 GiB) [nvml]
    assert "devices (79.65 GiB each)" in out.stdout and "| across nodes |" in out.stdout
    rows = {line.split(" | ")[1]: line for line in out.stdout.splitlines() if line.startswith("| ") and " x " in line}
    assert rows["dp_shard256 x tp2"].endswith("| dp_shard |")  # TP's 2 ranks share a node, FSDP's 256 do not
    bad = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "--device", "h300", "--world", "8"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--device 'h300': no spec sheet for it; choose from h100, h100_500w" in bad.stderr


@pytest.mark.quick
def test_the_model_ends_count_as_blocks_so_405b_splits_over_128_stages():
    """Llama 3.1 405B's 126 blocks over 16 ranks x 8 stages (Megatron-Bridge's GB200 layout) are
    refused until the embedding and the output count as a block each, as TorchTitan's
    first/last_stage_less_layers and Megatron's account_for_*_in_pipeline_split count them: then
    the first stage holds the embedding alone, the last the output alone, and the end ranks one
    block fewer, which the planner prices and the memory model counts."""
    assert [len(r) for r in layer_split(8, 4, 1, 1)] == [2, 3, 2, 1]  # 10 counted over 4: 3 3 2 2, less the ends
    layout = ["model=llama3_405b", "training.seq_len=8192", "parallelism.tensor_parallel_degree=4",
              "parallelism.pipeline_parallel_degree=16", "parallelism.pipeline_parallel_schedule=Interleaved1F1B",
              "parallelism.pipeline_parallel_stages_per_rank=8", "parallelism.data_parallel_shard_degree=-1",
              "training.local_batch_size=16",
              "cluster=slurm", "cluster.nnodes=64", "cluster.nproc_per_node=4", "cluster.gpus_per_node=4"]
    (refused,) = validate(job_config(layout), cuda=True)
    assert "128 stages but model.n_layers = 126" in refused and "first_stage_less_layers=1" in refused
    job = job_config([*layout, "parallelism.pipeline_parallel_first_stage_less_layers=1",
                      "parallelism.pipeline_parallel_last_stage_less_layers=1"])
    assert validate(job, cuda=True) == []
    job = resolve(job)
    split = layer_split(126, 128, 1, 1)
    assert (len(split[0]), len(split[-1]), {len(r) for r in split[1:-1]}) == (0, 0, {1})
    loads = rank_loads(job.parallelism, 126)
    assert [(r.blocks, r.first, r.last) for r in (loads[0], loads[1], loads[-1])] == [(7, True, False), (8, False, False),
                                                                                    (7, False, True)]
    step = predict_step(job, spec_profile(SPECS["gb200"], 256, 4), cuda=True)
    assert step.tokens_per_s_per_device > 0 and step.parts["bubble"] > 0
    ends = [predict_memory(job, cuda=True, pp_rank=k)["total"] for k in (0, 1, 15)]
    assert ends[0] < ends[1] and ends[2] < ends[1] + 2  # a block fewer; the last holds the output and its logits


def test_torchtitans_published_tables_validate_and_plan_for_cuda():
    """Every configuration of TorchTitan's published H100 tables (issue 36) validates for CUDA and
    is predicted: the benchmark runs to its summary line. A refusal seen on CPU over gloo (full AC
    with compile and TP, Tables 4-6) stays on CPU."""
    out = subprocess.run([sys.executable, "benchmarks/bench_torchtitan.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 18 and {line.split("|")[1].strip()[0] for line in rows} == set("123456")
    assert "held-out rows: 13 for tokens/s, 14 for memory;" in out.stdout
    assert "| 4 (fit: tokens/s) | 2D + async TP |" in out.stdout  # bench_published.py's fitting set, not scored
    cpu = job_config(["parallelism=tp", "compile.enable=true", "activation_checkpoint.mode=full"])
    assert any("fails on CPU" in e for e in validate(cpu, cuda=False)) and validate(cpu, cuda=True) == []


def test_the_gpu_parts_beside_xlas_published_microbenchmarks(monkeypatch, capsys):
    """benchmarks/bench_parts.py (issue 36): XLA's measured GEMMs and collectives, as read from its
    tables into benchmarks/data, beside what a spec sheet's parts price them at. Where the parts are
    known to hold, the two agree, which checks the reading and the units: H100's largest bf16 GEMM
    (4 x 4,096 rows by 4,096 by 4,096, 789 TFLOP/s measured) within 5 %; GB200's largest all-gather
    over 8 GPUs (767 GB/s) within 10 %. Every spec sheet and kind is scored, and BENCHMARKS.md shows
    the summary line the bench prints now."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_parts as bench
    from titan_exp.perf.gpu import gemm_s
    from titan_exp.perf.kernel_rates import spec_kernels

    gemms, collectives = bench.read(bench.GEMMS), bench.read(bench.COLLECTIVES)
    gemm = next(r for r in gemms if r["xla_gpu"] == "sm_90" and r["dtype"] == "bfloat16"
                and (r["b"], r["m"], r["n"], r["k"]) == ("4", "4096", "4096", "4096"))
    rows, side = 4 * 4096, 4096
    priced = 2 * rows * side * side / gemm_s(spec_kernels(SPECS["h100"]), rows, side, side, "bfloat16") / 1e12
    assert float(gemm["tflops"]) == pytest.approx(789, abs=1) and priced == pytest.approx(789, rel=0.05)
    gather = max((r for r in collectives if r["xla_gpu"] == "sm_100_GB200" and r["op"] == "all_gather"
                  and (r["groups"], r["group_size"]) == ("9", "8")), key=lambda r: int(r["bytes"]))
    size = int(gather["bytes"])
    priced = size / spec_profile(SPECS["gb200"], 72, 72).collective("all_gather", 8)(size) / 1e9
    assert float(gather["gb_s"]) == pytest.approx(767, abs=1) and priced == pytest.approx(767, rel=0.10)
    assert bench.above_peak(gemms) == {("sm_90", "float8")}  # 2,593 TFLOP/s at its best: left out
    assert set(bench.gemm_errors(gemms)) == {(spec, dtype, band) for spec in ("h100", "b200")
                                             for dtype in ("bfloat16", "float32", "float8")
                                             for band in ("every shape", bench.BIG_BAND)} - {
        ("h100", "float8", "every shape"), ("h100", "float8", bench.BIG_BAND)}
    assert set(bench.collective_errors(collectives)) == {(spec, op, band) for spec in ("h100", "b200", "gb200", "gb300")
                                                         for op in bench.OPS.values() for _, band in bench.SIZE_BANDS}
    assert bench.main([]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("parts against XLA's tables: ") and last in (REPO / "BENCHMARKS.md").read_text()


def test_published_gpu_rows_are_the_jobs_they_describe_and_scored_leave_one_source_out(monkeypatch):
    """benchmarks/bench_published.py (issue 36): an MPT row becomes a job with the published
    parameter count (its learned position embedding aside), every TorchTitan row plans for CUDA,
    and the leave-one-source-out summary is the last line, as a spec sheet's plan quotes it
    (perf.devices.SPEC_ACCURACY)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_published as bench
    import published_engines as engines
    import published_megatron as megatron
    from titan_exp.perf.devices import Efficiency

    planned = bench.plan_rows(bench.read_rows())
    mpt = [p for p in planned if p.row.source == "llm_foundry" and p.job is not None]
    assert len(mpt) >= 100
    for p in mpt:
        m = p.job.model
        published = p.row.num("params_b") * 1e9 - p.job.training.seq_len * m.dim
        assert m.num_params == pytest.approx(published, rel=2e-3), p.row.key
    assert sum(p.row.source == "torchtitan" and p.job is not None for p in planned) == 18
    # Qwen3's MoE rows: heads 128 wide (model.head_dim) and routed experts give the model cards'
    # total and active parameters (30.5B / 3.3B, 235B / 22B); EP as the row states; all held out.
    moe = {p.row["model"]: p for p in planned if bench.is_moe(p.row) and p.job is not None}
    for name, (total, active) in {"qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9)}.items():
        m = moe[name].job.model
        assert m.num_params == pytest.approx(total, rel=0.01) and m.active_params == pytest.approx(active, rel=0.03)
        assert moe[name].job.parallelism.expert_parallel_degree == int(moe[name].row.num("ep"))
    # GPT-OSS 120B: 116.8B parameters, 5.13B active without the embedding table (the model card's count).
    m = moe["gpt_oss_120b"].job.model
    assert m.num_params == pytest.approx(116.8e9, rel=0.01)
    assert m.active_params - m.vocab_size * m.dim == pytest.approx(5.13e9, rel=0.01)
    # Megatron's data parallel without FSDP, in an MoE row: HSDP over the EP groups (moe_replicas), so
    # nothing crosses nodes each microbatch that Megatron's distributed optimizer moves once a step.
    hsdp = [p for p in planned if p.job is not None and bench.moe_replicas(p.row) > 1]
    assert hsdp and all(p.job.parallelism.data_parallel_shard_degree * p.job.parallelism.context_parallel_degree
                        == p.job.parallelism.expert_parallel_degree
                        and p.job.parallelism.data_parallel_replicate_degree == bench.moe_replicas(p.row) for p in hsdp)
    # examined, so moved out of the held-out scores; MLA's rows, planned after, only where the multi-token
    # prediction layer's pass through the output head was priced for them (PP 16 without VP on B200s, B300s),
    # or EP's overlap with another microbatch's compute (ep_overlapped)
    pp16 = lambda row: (row["model"], row["pp"], row["vp"] in ("", "1"), row["gpu"] in ("b200", "b300")) == (  # noqa: E731
        "deepseek_v3", "16", True, True)
    assert all(bool(bench.moved(p.row)) == (p.row["model"] not in bench.MLA_MODELS or pp16(p.row)
                                            or bench.ep_overlapped(p.row)) for p in hsdp)
    eff = Efficiency()
    with_mpt = [bench.predict(p, eff) for p in mpt[:5]]  # MPT's own memory-bound kernels (engines.MPT), not Llama's
    with monkeypatch.context() as patch:
        patch.setattr(bench, "elementwise", lambda row: engines.TORCHTITAN_LLAMA)
        assert all(a > 1.02 * b for a, b in zip(with_mpt, (bench.predict(p, eff) for p in mpt[:5])))
    engine = engines.ENGINES["megatron_bridge"]  # Transformer Engine overlaps TP's collectives: priced as async TP
    mb = [p for p in planned if p.row.source == "megatron_bridge" and p.job is not None]
    assert engine.tp_overlap and all(p.job.parallelism.enable_async_tensor_parallel == (int(p.row.num("tp", 1)) > 1)
                                     for p in mb)
    assert not [p.why_not for p in planned if p.why_not and p.why_not.startswith("not built")]
    # MLA's rows (DeepSeek-V3, Kimi K2), named held out before any was predicted: the seven PP 16 ones
    # moved since, all planned but the six whose table states no precision; DeepSeek-V3 with its multi-
    # token-prediction layer as one more block (671B and one MoE block's 11.5B) and a second pass through
    # the output head, Kimi K2 without (1.03T, 32.9B active); their pipelines as their recipes' layout
    # strings place the blocks where those have the row's stages.
    # EP's all-to-alls overlapped with another microbatch's compute where the recipe sets it and its
    # dispatch never waits for the host (the step one CUDA graph: v0.5.0's 26.06 tables on), not
    # where it sets it with a dropless dispatch (12 rows of earlier tables)
    pairing = [p for p in planned if p.job is not None
               and (bench.recipe(p.row) or {}).get("moe_a2a_overlap", "").startswith("true")]
    overlapped = {p.row.table.split()[0] for p in pairing if bench.ep_overlapped(p.row)}
    assert len(pairing) == 38 and overlapped == {"26.06", "26.06.01", "26.08"}
    assert sum(map(bench.ep_overlapped, (p.row for p in pairing))) == 26
    mla = [p for p in planned if p.row["model"] in bench.MLA_MODELS]
    assert len(mla) == 39 and sum(pp16(p.row) for p in mla if bench.moved(p.row) and p.job is not None) == 7
    assert (megatron.output_heads("deepseek_v3"), megatron.output_heads("kimi_k2")) == (2, 1)
    assert sorted(str(p.why_not) for p in mla if p.job is None) == ["precision not stated"] * 6
    shapes = {p.row["model"]: p.job.model for p in mla if p.job is not None}
    assert shapes["deepseek_v3"].mla and shapes["deepseek_v3"].n_layers == 62
    assert shapes["deepseek_v3"].num_params == pytest.approx(671.03e9 + shapes["deepseek_v3"].block_params, rel=1e-3)
    assert shapes["kimi_k2"].num_params == pytest.approx(1.026e12, rel=1e-3)
    assert shapes["kimi_k2"].active_params == pytest.approx(32.86e9, rel=1e-3)
    ends = {(p.row["model"], p.row["gpu"], p.row.table.split()[0]): (
        p.job.parallelism.pipeline_parallel_first_stage_less_layers, p.job.parallelism.pipeline_parallel_last_stage_less_layers)
        for p in mla if p.job is not None}
    assert ends[("deepseek_v3", "gb300", "26.08")] == (0, 2)  # Et*4|(t*4|)*14tmL over PP 2 x VP 8
    assert ends[("kimi_k2", "gb300", "26.06")] == (0, 3)  # Et*4|(t*4|)*14tL
    assert ends[("deepseek_v3", "gb300", "25.11")] == (0, 0)  # its recipe's 16 stages, not the table's PP 2 x VP 4
    assert {p.row.key for p in bench.fitting_set(planned)} >= {p.row.key for p in planned
                                                             if p.row.source == "torchtitan" and p.row.table.startswith("Table 1")}
    fitting = bench.fitting_set(planned)
    assert not [p for p in fitting if bench.is_moe(p.row)]
    moved = [p for p in planned if p.job is not None and bench.moved(p.row)]
    # Moved rows leave every score; the dense ones fit, the MoE ones stay out of the fit as all MoE rows do.
    assert moved and all((p in fitting) != bench.is_moe(p.row) for p in moved)
    assert all(any(rows(p.row) for p in planned) for _, rows in bench.MOVED_TO_FIT)  # each names rows that exist
    derived = [p for p in planned if p.row["derived"] == "true"]  # layouts the sources do not state as run
    assert len(derived) == 4 and all(p.job is not None and bench.moved(p.row) for p in derived)
    assert {(p.job.parallelism.tensor_parallel_degree, p.job.parallelism.pipeline_parallel_degree,
             p.job.parallelism.pipeline_parallel_stages_per_rank, p.job.parallelism.expert_parallel_degree)
            for p in derived} == {(8, 6, 1, 1), (1, 4, 5, 1), (1, 1, None, 16)}  # None: no pipeline
    # Rows a table footnotes as a known performance regression are scored nowhere and repeat nothing.
    regressed = [p for p in planned if bench.known_regression(p.row)]
    assert len(regressed) == 2 and all(p.job is not None and bench.moved(p.row) for p in regressed)
    assert bench.fit(fitting).compute_scale == pytest.approx(Efficiency().compute_scale, abs=1e-3)  # the planner's is the fit's
    # Every Megatron-Bridge row it plans has the recipe its release's tag ran (published_recipes.csv),
    # and its MoE rows fall into the groups the bench reports them by.
    assert all(bench.recipe(p.row) for p in mb) and not [p for p in planned if bench.recipe(p.row) and
                                                         p.row.source != "megatron_bridge"]
    qwen = {(p.row.table.split()[0], p.row["gpu"]): p for p in mb if p.row["model"] == "qwen3_30b_a3b"}
    groups = bench.recipe_groups([(qwen[("26.06", "gb200")], 0.0, -0.3), (qwen[("25.11", "b200")], 0.0, 1.5),
                                  (qwen[("26.04", "b200")], 0.0, -0.02)])
    assert groups == ("one CUDA graph a step, FP8 attention, all-to-all overlapped, fused grouped MLP (v0.5.0 on): "
                      "1 rows, median -30 %; NCCL's all-to-all (alltoall dispatcher): 1 rows, median +150 %; "
                      "HybridEP's dispatch: 1 rows, median -2 %")
    # One configuration published in two tables, 3x apart: no prediction is within 50 % of both.
    first = bench.read_rows()[0]
    again = bench.Row(first.source, "a later release", first.label, {**first.cells, "table": "a later release",
                      "tokens_per_s_per_gpu": str(3 * first.num("tokens_per_s_per_gpu"))})
    assert "1 configurations, 2 rows" in bench.repeats([first, again]) and "within 50 % of both" in bench.repeats(
        [first, again])
    assert bench.repeats([first]) == "no configuration is published twice"
    footnoted = bench.Row(again.source, again.table, again.label,
                          {**again.cells, "note": "source footnote: a known performance regression"})
    assert bench.repeats([first, footnoted]) == "no configuration is published twice"
    # Pairs of one table on one machine: ordered as published, or not; another machine's row is no pair.
    faster = bench.Row(first.source, first.table, "faster", {**first.cells, "tokens_per_s_per_gpu": str(
        2 * first.num("tokens_per_s_per_gpu"))})
    elsewhere = bench.Row(first.source, first.table, "elsewhere", {**first.cells, "gpus": "512"})
    rows = [bench.Planned(first, None, None), bench.Planned(faster, None, None), bench.Planned(elsewhere, None, None)]
    assert bench.machine_pairs(list(zip(rows, (1.0, 2.0, 9.0)))) == (1, 1)
    assert bench.machine_pairs(list(zip(rows, (2.0, 1.0, 0.5)))) == (0, 1)
    # A table out of order, named by what tells the swapped rows apart: two GPUs, or one GPU's layouts.
    other_gpu = bench.Row(first.source, first.table, "other GPU", {**faster.cells, "gpu": "gb300"})
    swapped = [bench.Planned(first, None, None), bench.Planned(other_gpu, None, None)]
    assert bench.swapped_pairs({"t": list(zip(swapped, (2.0, 1.0)))}) == {f"gb300 over {first['gpu']}": 1}
    assert bench.swapped_pairs({"t": list(zip(swapped, (1.0, 2.0)))}) == {}
    assert bench.swapped_pairs({"t": list(zip(rows[:2], (2.0, 1.0)))}) == {"two layouts of one model on one GPU": 1}
    # One configuration on two GPUs: the later-named GPU's tokens/s over the other's, published and predicted;
    # rows that differ in anything but the GPU (and what a row says of itself) are no such pair.
    later, earlier = sorted((first["gpu"], "gb300"), reverse=True)
    ratio = 2.0 if later == "gb300" else 0.5  # other_gpu published twice first's tokens/s
    assert bench.gpu_pairs(list(zip(swapped, (3.0, 3.0)))) == (
        f"{later} over {earlier}, 1 configuration: published {ratio:.2f} ({ratio:.2f}-{ratio:.2f}), "
        "predicted 1.00 (1.00-1.00)")
    assert bench.gpu_pairs(list(zip([swapped[0], bench.Planned(bench.Row(first.source, first.table, "wider", {
        **other_gpu.cells, "gpus": "512"}), None, None)], (1.0, 1.0)))) == ""
    out = subprocess.run([sys.executable, "benchmarks/bench_published.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| torchtitan | compute_scale" in out.stdout and "| 5 of 5 | 19 of 19 |" in out.stdout  # every held-out
    # TorchTitan table, every pair on one machine, in order
    # context parallelism's published effect: each doubling of CP and of the sequence (Tables 2 and 6)
    cp = [line for line in out.stdout.splitlines() if "| context parallel |" in line]
    assert len(cp) == 6 and "| Table 2: FSDP 8, CP 1 -> FSDP 4, CP 2 | -35 % |" in cp[0]
    assert "Held-out techniques within 5 points of their published effect: " in out.stdout
    assert "One configuration on two GPUs in a held-out table (gpu_pairs), the first's tokens/s over the second's: " \
        "gb300 over gb200, 8 configurations: published 1.23 (1.15-1.27)" in out.stdout
    # What a spec sheet's plan says of its accuracy (perf.devices.SPEC_ACCURACY) is what the bench measures.
    last = out.stdout.strip().splitlines()[-1]
    held = re.match(r"held-out: (\d+) rows from \d+ sources; tokens/s median \|error\| (\d+) %", last)
    sources = [line.split(" | ") for line in out.stdout.splitlines() if re.match(r"\| \w+ \| compute_scale .* of ", line)]
    ordered = [tuple(map(int, cells[-1].strip(" |").split(" of "))) for cells in sources]
    assert held and (int(held[1]), int(held[2]) / 100) == (SPEC_ACCURACY["rows"], SPEC_ACCURACY["median_abs_error"])
    assert (sum(k for k, _ in ordered), sum(n for _, n in ordered)) == SPEC_ACCURACY["pairs_ordered"]
    memory = re.search(r"memory median \|error\| (\d+) %, worst (\d+) % \((\d+) rows", last)
    assert memory and (int(memory[3]), int(memory[1]) / 100, int(memory[2]) / 100) == SPEC_ACCURACY["memory"]
    devices = next(line for line in out.stdout.splitlines() if line.startswith("By spec sheet"))
    quoted = {name: (int(n), int(signed) / 100, int(size) / 100) for name, n, signed, size in re.findall(
        r"(\w+) (\d+) rows?, median error ([+-]\d+) %, \|error\| (\d+) %", devices)}
    assert quoted == SPEC_ACCURACY["by_device"] and sum(n for n, _, _ in quoted.values()) == SPEC_ACCURACY["rows"]


@pytest.mark.quick
def test_a_hardware_file_describes_the_cluster_and_bad_ones_are_refused(tmp_path):
    """--hardware FILE (issue 36): the file's values replace the spec sheet's, the plan says which,
    and every mistake names the file, the key and the value."""
    from titan_exp.perf.devices import SPECS, load_hardware, spec_profile

    def write(text: str):
        path = tmp_path / "hw.yaml"
        path.write_text(text)
        return path

    hw = load_hardware(write("device: h100\ngpus_per_node: 4\nnvlink_gb_s: 100\nlatency_network_us: 30\n"))
    assert (hw.spec.nvlink_gb_s, hw.spec.network_gb_s, hw.gpus_per_node) == (100, SPECS["h100"].network_gb_s, 4)
    assert hw.efficiency.latency_network_s == pytest.approx(30e-6)
    assert "nvlink_gb_s 100" in hw.line() and "gpus_per_node 4" in hw.line()
    slow, spec = spec_profile(hw.spec, 16, 4, hw.efficiency), spec_profile(SPECS["h100"], 16, 4)
    gather = lambda p: p.collectives["all_gather"][4].per_unit_s  # noqa: E731
    assert gather(slow) == pytest.approx(gather(spec) * 450 / 100)

    own = load_hardware(write("device: {bf16_tflops: 500, tf32_tflops: 250, memory_gib: 64, memory_tb_s: 2}\n"
                              "nvlink_gb_s: 200\nnetwork_gb_s: 25\n"))
    assert own.spec.fp8_tflops is None and "float8" not in spec_profile(own.spec, 8, 8).gemm
    shares = load_hardware(write("device: {bf16_tflops: 500, fp8_tflops: 1000, tf32_tflops: 250, memory_gib: 64, "
                                 "memory_tb_s: 2, matmul_share: 0.8, fp8_share: 0.6}\n"
                                 "nvlink_gb_s: 200\nnetwork_gb_s: 25\n"))
    gemm = spec_profile(shares.spec, 8, 8).gemm  # each dtype at its own share of its peak
    assert gemm["bfloat16"].per_unit_s == pytest.approx(1 / 400e12)
    assert gemm["float8"].per_unit_s == pytest.approx(1 / 600e12)
    # NCCL's bus bandwidth as nccl-tests measured it (busbw) is taken as it is, in place of a link's rate.
    measured = load_hardware(write("device: h100\nnvlink_bus_gb_s: 300\nnetwork_bus_gb_s: 40\n"))
    assert "nvlink_bus_gb_s 300" in measured.line() and "network_bus_gb_s 40" in measured.line()
    profile = spec_profile(measured.spec, 16, 8, measured.efficiency)
    assert profile.collectives["all_reduce"][8].per_unit_s == pytest.approx(2 * 7 / 8 / 300e9)
    assert profile.inter_node["all_gather"][2].per_unit_s == pytest.approx(1 / 2 / 40e9)
    assert spec_profile(SPECS["h100"], 16, 8).collectives["all_reduce"][8].per_unit_s == pytest.approx(
        2 * 7 / 8 / (450e9 * 0.8))

    for text, message in [
        ("device: h100\nnvlnk_gb_s: 3\n", "unknown key(s) nvlnk_gb_s (did you mean nvlink_gb_s?)"),
        ("device: h300\n", "device = 'h300': no spec sheet for it"),
        ("device: {bf16_tflops: 500}\n", "missing tf32_tflops, memory_gib, memory_tb_s"),
        ("device: h100\ngpus_per_node: 2.5\n", "gpus_per_node = 2.5: must be a whole number > 0"),
        ("device: h100\nnvlink_gb_s: -1\n", "nvlink_gb_s = -1: must be a number > 0"),
        ("device: h100\npower_limit_w: 0\n", "power_limit_w = 0: must be a number > 0"),
        ("device: h100\nhost_cpu: arm\n", "host_cpu = 'arm': choose from x86, grace"),
        ("device: {bf16_tflops: 1, tf32_tflops: 1, memory_gib: 1, memory_tb_s: 1, sms: 1.5}\n",
         "device.sms = 1.5: must be a whole number > 0"),
        ("device: {bf16_tflops: 1, tf32_tflops: 1, memory_gib: 1, memory_tb_s: 1, fp8_share: 1.2}\n"
         "nvlink_gb_s: 1\nnetwork_gb_s: 1\n", "device.fp8_share = 1.2: a share of the peak, at most 1"),
        ("gpus_per_node: 8\n", "needs a mapping with at least `device`"),
        ("device: {bf16_tflops: 1, tf32_tflops: 1, memory_gib: 1, memory_tb_s: 1}\n",
         "needs nvlink_gb_s (or nvlink_bus_gb_s) and network_gb_s (or network_bus_gb_s)"),
        ("device: h100\nnvlink_gb_s: 450\nnvlink_bus_gb_s: 360\n", "nvlink_gb_s = 450 and nvlink_bus_gb_s = 360: give one"),
        ("device: h100\nnetwork_bus_gb_s: 0\n", "network_bus_gb_s = 0: must be a number > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_hardware(write(text))


def test_plan_cli_reads_a_hardware_file(tmp_path):
    (tmp_path / "hw.yaml").write_text("device: h100\ngpus_per_node: 4\nnvlink_gb_s: 100\n")
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "model=llama3_8b", "--world", "16", "--top", "2",
                          "--hardware", str(tmp_path / "hw.yaml")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith(f"hardware from {tmp_path / 'hw.yaml'}: device h100, gpus_per_node 4")
    both = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "model=llama3_8b", "--world", "16", "--device",
                           "h100", "--hardware", str(tmp_path / "hw.yaml")], cwd=REPO, capture_output=True, text=True)
    assert both.returncode == 2 and "leave out --device and --gpus-per-node" in both.stderr
