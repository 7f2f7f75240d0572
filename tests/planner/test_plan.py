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
from titan_exp.perf import plan as plan_cli
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.memory_gpu import LOSS_UNITS
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.accuracy import published
from titan_exp.perf.rates.devices import SPECS, spec_profile
from titan_exp.perf.search import layouts, planner, sweep
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
        candidate = layouts.with_layout(job, dict(zip(layouts.MESH_DIMS, degrees)), 8)
        if not validate(candidate, cuda=False):
            brute.add(degrees)
    found = {tuple(layouts.degrees_of(j).values()) for j in layouts.valid_layouts(job, world)}
    assert found == brute
    assert len(found) >= {1: 1, 2: 4, 4: 10, 6: 0, 8: 10}[world]  # 6 ranks: nothing divides heads and batch


@pytest.mark.quick
def test_memory_model_shards_states_and_ranks_by_fit():
    job = job_config(BASE)
    single = predict_memory(layouts.with_layout(job, dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1), 8))
    for n in (2, 4, 8):
        fsdp = predict_memory(layouts.with_layout(job, dict(pp=1, dp_replicate=1, dp_shard=n, cp=1, tp=1), 8))
        assert fsdp["states"] == pytest.approx(single["states"] / n)
    ddp = predict_memory(layouts.with_layout(job, dict(pp=1, dp_replicate=4, dp_shard=1, cp=1, tp=1), 8))
    assert ddp["states"] == pytest.approx(single["states"])
    full_ac = predict_memory(job_config([*BASE, "activation_checkpoint.mode=full"]))
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
    gradients over several microbatches; a GPU counts the same tensors, its loss as an H200 counted
    it, and no fragmentation; the logits are split by TP only under loss parallel."""
    gib = 2**30
    job = job_config(["model=llama3_8b", "training.seq_len=8192", "training.local_batch_size=1",
                      "precision=bf16", "activation_checkpoint.mode=full"])
    m = job.model

    def memory(global_batch=8, job=job, **degrees):
        layout = dict(dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1), **degrees)
        return predict_memory(layouts.with_layout(job, layout, global_batch), cuda=True)

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
        single, several = (predict_memory(layouts.with_layout(pipeline, dict(
            pp=4, dp_replicate=1, dp_shard=2, cp=1, tp=1), n), cuda=cuda) for n in (2, 16))
        assert several["fsdp_working_set"] > single["fsdp_working_set"] * 1.5

    # A GPU counts what a CPU counts but the loss (an H200's units of bf16 logits, 7 eager) and adds
    # no fragmentation (expandable segments); a CPU's slack is glibc's heap.
    layout = layouts.with_layout(job, dict(pp=1, dp_replicate=1, dp_shard=8, cp=1, tp=1), 8)
    on_gpu, on_cpu = predict_memory(layout, cuda=True), predict_memory(layout)
    assert on_gpu["states"] == fsdp["states"] and on_gpu["checkpoints"] == fsdp["checkpoints"]
    assert on_gpu["activations"] == pytest.approx(on_cpu["activations"])  # bf16 under FSDP on either
    assert on_gpu["logits"] == pytest.approx(tokens * m.vocab_size * LOSS_UNITS["eager"] * 2 / gib)
    assert on_gpu["allocator"] == 0 < on_cpu["allocator"]

    no_loss_parallel = predict_memory(layouts.with_layout(
        job_config(["model=llama3_8b", "training.seq_len=8192", "training.local_batch_size=1", "precision=bf16",
                    "parallelism.disable_loss_parallel=true"]), dict(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=8), 1),
        cuda=True)
    assert no_loss_parallel["logits"] > 7 * tp["logits"]


def test_cli_prints_the_ranking_and_writes_a_sweep(tmp_path, monkeypatch):
    proc = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *BASE, "--world", "4",
                           "autotune.calibrate=false", "--top", "3",  # an override after a flag is read as one too
                           "--device-memory-gib", "8"], cwd=REPO, capture_output=True, text=True, check=True)
    assert "valid layouts on 4 devices" in proc.stdout and "| 1 |" in proc.stdout
    job = job_config(BASE)
    plans = planner.plan(job, 4, device_memory_gib=8)
    monkeypatch.setenv("TITAN_EXP_SWEEPS", str(tmp_path))  # the user's sweeps/, never the package
    out = sweep.write_sweep(plans, "p4", 3, BASE)
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
    sweep.write_sweep(planner.plan(job_config(two), 4, device_memory_gib=8), "p4n2", 1, two)
    job = job_config([*two, "+plan_layout=p4n2_0"])
    assert (job.cluster.nnodes, job.cluster.nproc_per_node, job.world_size) == (2, 2, 4)


@pytest.mark.quick
def test_the_plan_searches_the_axes_autotune_search_names(tmp_path, monkeypatch):
    """autotune.search names the axes the plan searches besides the layout, as autotune does
    (perf.search.axes): each layout at each AC mode and compile on and off, named so; the job's own
    settings marked, at the plain plan's predictions; a sweep written from it runs each candidate
    as planned. A precision preset is swapped as `precision=NAME` composes it: a float8 job's bf16
    candidate has no float8 converter (it had kept the job's), and a field set beyond the preset
    stays."""
    from titan_exp.config import AutotuneAxis, register_configs
    from titan_exp.perf.search.axes import variants

    base = [*BASE, "activation_checkpoint.mode=full"]
    job = job_config([*base, "autotune.search=[layout,activation_checkpoint,compile]"])
    plain = planner.plan(job, 2, device_memory_gib=8)
    searched = planner.plan(job, 2, device_memory_gib=8, axes=job.autotune.search)
    assert {pl.settings for pl in searched} == {(f"activation_checkpoint.mode={mode}", f"compile.enable={on}")
                                               for mode in ("none", "selective", "full") for on in ("false", "true")}
    assert all(pl.name.endswith(f"AC {pl.settings[0].split('=')[1]}, compile={pl.settings[1].split('=')[1]}")
               for pl in searched)
    own = [pl for pl in searched if pl.configured]
    assert {pl.settings for pl in own} == {("activation_checkpoint.mode=full", "compile.enable=false")}
    assert sorted((pl.name.split(",")[0], pl.split, pl.tokens_per_s) for pl in own) == sorted(
        (pl.name, pl.split, pl.tokens_per_s) for pl in plain)
    monkeypatch.setenv("TITAN_EXP_SWEEPS", str(tmp_path))
    sweep.write_sweep(searched, "s2", 3, base)
    register_configs()  # the user's sweeps/, as launch.py finds them
    chosen = [pl for pl in searched if pl.fits][:3]
    run = sweep.sweep_overrides(chosen, base)  # the command line the sweep runs with: AC and the batch are the plans'
    assert run == [o for o in BASE if not o.startswith(("training.local_batch_size", "training.global_batch_size"))]
    assert f"+sweep=s2 {' '.join(run)}\n" in (tmp_path / "s2.yaml").read_text()
    for i, pl in enumerate(chosen):
        ran = job_config([*run, f"+plan_layout=s2_{i}"])
        assert (f"activation_checkpoint.mode={ran.activation_checkpoint.mode.value}",
                f"compile.enable={str(ran.compile.enable).lower()}") == pl.settings
    # the precision axis: the member's job (its preset chosen, the command line's fields kept) is the predicted one
    kept = "precision.float8_enable_fsdp_all_gather=true"
    f8 = job_config([*base, "precision=float8", kept])
    for variant, settings in variants(f8, [AutotuneAxis.precision], cuda=True):
        assert variant.precision == job_config([*base, kept, *settings]).precision, settings
        assert (variant.precision.converter.value == "none") == (settings == ["precision=bf16"])
    on_cpu = job_config([*base, "precision=float8", kept, "autotune.search=[layout,precision]"])
    planned = planner.plan(on_cpu, 2, device_memory_gib=8, axes=on_cpu.autotune.search)
    assert {pl.settings for pl in planned} == {("precision=fp32",), ("precision=bf16",)}
    assert not [pl for pl in planned if pl.configured]  # float8 is no CPU candidate
    sweep.write_sweep(planned, "p2", 2, [*base, "precision=float8", kept])
    chosen = [pl for pl in planned if pl.fits][:2]
    for i, pl in enumerate(chosen):
        ran = job_config([*sweep.sweep_overrides(chosen, [*base, "precision=float8", kept]), f"+plan_layout=p2_{i}"])
        assert ran.precision == job_config([*base, kept, *pl.settings]).precision


@pytest.mark.quick
def test_the_plan_compares_layouts_at_the_configured_batch_and_places_the_configured_one():
    """With no global batch set, every layout is compared at the batch the job would run: its local
    batch on each data-parallel rank of its configured layout (as `resolve` fills it for a launch),
    not on every rank, which for TorchTitan's 70B (FSDP 32 x TP 8, local batch 16) had been 4,096
    sequences where TorchTitan ran 512 (issue 36). The job as configured is shown beside the plans:
    its prediction, and where its layout ranks; refused, the refusal; not a layout of the world, the
    field that would make it one."""
    tp = ["model=llama3_8b", "precision=fp32", "activation_checkpoint.mode=none", "training.seq_len=2048",
          "training.local_batch_size=4", "parallelism=fsdp",
          "parallelism.tensor_parallel_degree=4", "cluster=slurm", "cluster.nnodes=2", "cluster.nproc_per_node=8"]
    job, profile = job_config(tp), spec_profile(SPECS["h100"], 16, 8)
    assert layouts.global_batch_of(job, 16) == resolve(job).training.global_batch_size == 4 * 4
    plans = planner.plan(job, 16, device_memory_gib=80, cuda=True, profile=profile, any_split=True)
    assert next(pl for pl in plans if pl.degrees["dp_shard"] == 16).split == "local batch 1"  # 16 sequences on 16
    rank = 1 + next(i for i, pl in enumerate(plans) if pl.degrees == dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=4))
    tokens = predict_step(resolve(job), profile, cuda=True).tokens_per_s_per_device
    line = plan_cli.configured_line(job, 16, plans, profile, device_memory_gib=80, cuda=True)
    assert line.startswith(f"your configuration (dp_shard4 x tp4, local batch 4): {tokens:,.0f} tokens/s/device, ")
    assert f"its layout ranks {rank} of {len(plans)};" in line and rank > 1
    assert line.endswith(f"the fastest, {plans[0].name} ({plans[0].split}), is predicted "
                         f"{plans[0].tokens_per_s / tokens - 1:+.0%}")
    small = planner.plan(job, 16, device_memory_gib=30, cuda=True, profile=profile, any_split=True)
    cramped = plan_cli.configured_line(job, 16, small, profile, device_memory_gib=30, cuda=True)
    assert "GiB/device (does NOT fit)" in cramped and cramped.endswith(  # what fits beside it, not a percentage
        f"the fastest that fits, {small[0].name} ({small[0].split}), {small[0].tokens_per_s:,.0f} tokens/s/device")
    refused = job_config([*tp, "parallelism.tensor_parallel_degree=16"])
    assert plan_cli.configured_line(refused, 16, plans, profile, device_memory_gib=80, cuda=True) == (
        "your configuration (tp16, local batch 4) is refused on 16 devices: parallelism.tensor_parallel_degree = 16: "
        "does not divide model.n_kv_heads = 8; pick a degree that does")
    other = job_config([*tp, "parallelism.tensor_parallel_degree=3"])  # not a layout of 16: each rank's local batch
    assert layouts.global_batch_of(other, 16) == 64 and plan_cli.configured_line(other, 16, plans, profile,
                                                                               device_memory_gib=80, cuda=True) == (
        "your configuration (tp3) is not a layout of 16 devices, so it is not ranked: its degrees other than "
        "data_parallel_shard_degree multiply to 3, which does not divide 16; pick degrees whose product divides it")
    single = job_config([*tp, "parallelism.tensor_parallel_degree=2", "parallelism.data_parallel_shard_degree=2"])
    assert plan_cli.configured_line(single, 16, plans, profile, device_memory_gib=80, cuda=True) == (
        "your configuration (dp_shard2 x tp2) is not a layout of 16 devices, so it is not ranked: with "
        "parallelism.data_parallel_shard_degree = 2 they multiply to 4; set it to -1 (or 8) to shard data over all 16")
    assert plan_cli.configured_line(job_config([*tp, "parallelism.tensor_parallel_degree=2",
                                               "parallelism.data_parallel_shard_degree=8"]), 16, plans, profile,
                                   device_memory_gib=80, cuda=True).startswith("your configuration (dp_shard8 x tp2, "
                                                                               "local batch 4): ")
    assert layouts.batch_line(other, 16) == ("global batch: 64 sequences = 131,072 tokens for every layout, from "
                                             "training.local_batch_size 4 x 16 devices")
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", *tp[:-3], "--device", "h100", "--world", "16"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("global batch: 16 sequences = 32,768 tokens for every layout, from training.local_batch_size 4 x 4 "
            "data-parallel ranks of the configured layout, dp_shard4 x tp4") in out.stdout.splitlines()
    assert out.stdout.splitlines()[-1] == line


@pytest.mark.quick
def test_a_plan_near_the_memory_limit_says_so_and_names_one_with_the_memory_models_margin():
    """On GPUs the fastest plan that fits can sit closer to the device's memory than the memory
    model's worst error on held-out published runs (rates.accuracy.published's memory; the CUDA context is
    not counted either): the plan then says so and names the fastest layout with that margin."""
    job = job_config(["model=llama3_8b", "training.seq_len=8192", "training.global_batch_size=32",
                      "cluster=slurm", "cluster.nnodes=2", "cluster.nproc_per_node=8"])
    profile = spec_profile(SPECS["h100"], 16, 8)
    roomy = planner.plan(job, 16, device_memory_gib=80, cuda=True, profile=profile, any_split=True)
    _, _, worst = published()["memory"]
    assert 0 < worst < 0.25
    best = roomy[0]
    assert plan_cli.margin_line(roomy, best.memory_gib / (1 - worst) * 1.01) is None  # a margin wider than the worst
    device = best.memory_gib / (1 - worst / 2)  # the best fits, inside the worst error of the limit
    tight = planner.plan(job, 16, device_memory_gib=device, cuda=True, profile=profile, any_split=True)
    assert tight[0].name == best.name and tight[0].fits
    safe = next(pl for pl in tight if pl.memory_gib <= (1 - worst) * device)
    assert safe.name != best.name
    line = plan_cli.margin_line(tight, device)
    assert line.startswith(f"{best.name} ({best.split}) is predicted at {best.memory_gib:.2f} of {device:.2f} "
                           f"GiB/device, closer to the limit than the memory model's worst error")
    assert line.endswith(f"the fastest under {(1 - worst) * device:.2f} GiB, {safe.name} ({safe.split}), "
                         f"{safe.tokens_per_s:,.0f} tokens/s/device ({safe.tokens_per_s / best.tokens_per_s - 1:+.0%})")


# --- planning GPUs this machine does not have (spec sheets) ---------------------------------------

def test_spec_profile_follows_the_sheet_and_a_calibrated_one_wins(tmp_path):
    """A spec profile's costs come from its sheet (ring collectives over NVLink inside a node, over
    the NIC across nodes); a profile calibrated on that GPU, where one exists, replaces it."""
    import json

    from titan_exp.perf.rates.devices import SPECS, Efficiency, profile_for, spec_profile
    from titan_exp.perf.rates.profile import MachineProfile, machine_key

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
    header = out.stdout.splitlines()[:5]
    assert header[0] == "plan: llama3_8b (8.0B parameters), bf16, seq 8,192, AC selective, compile off"
    assert header[2] == "devices: 512 x h100, 79.65 GiB each, 64 nodes of 8"
    assert header[3].startswith("rates: from the spec sheet of h100") and all(len(line) <= 120 for line in header)
    runs, _, size = published()["by_device"]["h100"]  # its own accuracy on published runs, then the whole's
    assert header[4] == (f"accuracy: tokens/s off by {size:.0%} at the median on {runs} published h100 runs "
                         f"({published()['median_abs_error']:.0%} on all {published()['rows']}); a tie: within "
                         f"{size:.0%} of the fastest")
    # H100 80GB's memory as its driver shows it (81,559 MiB), not 80e9 bytes (74.5 GiB) [nvml]
    assert "devices (79.65 GiB each)" in out.stdout and "| across nodes |" in out.stdout
    rows = {line.split(" | ")[2]: line for line in out.stdout.splitlines() if line.startswith("| ") and " x " in line}
    assert rows["dp_shard256 x tp2"].endswith("| dp_shard |")  # TP's 2 ranks share a node, FSDP's 256 do not
    bad = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "--device", "h300", "--world", "8"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1  # one line, no usage
    assert "--device 'h300': no spec sheet for it; choose from h100, h100_500w" in bad.stderr


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
    assert [(r.blocks, r.first, r.last) for r in (loads[0], loads[1], loads[-1])] == [(7, True, False),
                                                                                    (8, False, False),
                                                                                    (7, False, True)]
    step = predict_step(job, spec_profile(SPECS["gb200"], 256, 4), cuda=True)
    assert step.tokens_per_s_per_device > 0 and step.parts["bubble"] > 0
    ends = [predict_memory(job, cuda=True, pp_rank=k)["total"] for k in (0, 1, 15)]
    assert ends[0] < ends[1] and ends[2] < ends[1] + 2  # a block fewer; the last holds the output and its logits


@pytest.mark.quick
def test_a_hardware_file_describes_the_cluster_and_bad_ones_are_refused(tmp_path):
    """--hardware FILE (issue 36): the file's values replace the spec sheet's, the plan says which,
    and every mistake names the file, the key and the value."""
    from titan_exp.perf.rates.devices import SPECS, spec_profile
    from titan_exp.perf.rates.hardware import load_hardware

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
        ("device: h100\nnvlink_gb_s: 450\nnvlink_bus_gb_s: 360\n",
         "nvlink_gb_s = 450 and nvlink_bus_gb_s = 360: give one"),
        ("device: h100\nnetwork_bus_gb_s: 0\n", "network_bus_gb_s = 0: must be a number > 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_hardware(write(text))


def test_plan_cli_reads_a_hardware_file(tmp_path):
    (tmp_path / "hw.yaml").write_text("device: h100\ngpus_per_node: 4\nnvlink_gb_s: 100\n")
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "model=llama3_8b", "--world", "16", "--top", "2",
                          "--hardware", str(tmp_path / "hw.yaml")], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0].startswith(f"hardware from {tmp_path / 'hw.yaml'}: device h100, gpus_per_node 4")
    both = subprocess.run([sys.executable, "-m", "titan_exp.perf.plan", "model=llama3_8b", "--world", "16", "--device",
                           "h100", "--hardware", str(tmp_path / "hw.yaml")], cwd=REPO, capture_output=True, text=True)
    assert both.returncode == 2 and "leave out --device and --gpus-per-node" in both.stderr
