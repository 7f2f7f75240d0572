"""cluster.dry_run: one rank of a 64- or 512-rank layout built and stepped alone, here, on torch's
fake process group; what it holds, measured, beside the planner's memory model."""

from __future__ import annotations

import re

import pytest
from conftest import launch_cli, run_job

from titan_exp.perf.model.memory import tensor_gib

SMALL_MODEL = ["model.n_layers=4", "training.seq_len=64", "metrics.log_freq=1"]
WORLD_64 = ["cluster.nnodes=8", "cluster.nproc_per_node=8"]
# A Qwen3 preset at the debug model's size; RoPE's tables at its 40,960 positions (21 MiB) are no
# part of the planner's memory model: at this size they would be most of the step's peak.
QWEN3_SMALL = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=4", "model.vocab_size=2048",
               "model.max_seq_len=2048"]
LAYOUTS = {  # name: (overrides, the rank to build)
    "fsdp": (["parallelism=fsdp", "training.global_batch_size=64", "training.local_batch_size=1"], 5),
    "hsdp": (["parallelism.data_parallel_replicate_degree=8", "parallelism.data_parallel_shard_degree=8",
              "training.global_batch_size=64", "training.local_batch_size=1"], 9),
    "tp": (["parallelism.tensor_parallel_degree=4", "parallelism.data_parallel_shard_degree=16",
            "training.global_batch_size=16", "training.local_batch_size=1"], 6),
    "pp": (["parallelism.pipeline_parallel_degree=4", "parallelism.data_parallel_shard_degree=16",
            "training.global_batch_size=64", "training.local_batch_size=4"], 63),  # the last stage
    # tied: the last stage holds a copy of the embedding as its output (parallel/pipeline.py sum_tied_grads)
    "pp_tied": (["parallelism.pipeline_parallel_degree=4", "parallelism.data_parallel_shard_degree=16",
                 "training.global_batch_size=64", "training.local_batch_size=4", "model.tie_word_embeddings=true",
                 "model.vocab_size=16384"], 63),
    "3d": (["parallelism.pipeline_parallel_degree=2", "parallelism.tensor_parallel_degree=2",
            "parallelism.data_parallel_shard_degree=16", "training.global_batch_size=32",
            "training.local_batch_size=2"], 40),
    # without EP: TP splits each routed expert's width, FSDP 32 shards the slices
    "tp_moe": (["model=moe_debug", "parallelism.data_parallel_shard_degree=32", "parallelism.tensor_parallel_degree=2",
                "training.global_batch_size=32", "training.local_batch_size=1"], 13),
    # one expert per rank, EP over 4 FSDP x 2 TP ranks, efsdp 8
    "tp_ep": (["model=moe_debug", "parallelism.data_parallel_shard_degree=32", "parallelism.tensor_parallel_degree=2",
               "parallelism.expert_parallel_degree=8", "training.global_batch_size=32",
               "training.local_batch_size=1"], 13),
    # Qwen3 shrunk to dim 256 (its presets' bf16, selective AC, 128-wide heads: 8 of them, 1024 wide
    # together; QK-norm over TP's heads); the MoE's 128 experts (16 a rank at EP 8, given rows by the
    # dry run's balanced counts whatever its router picks), Switch loss and softmax router
    "qwen3_tp": ([*QWEN3_SMALL, "model=qwen3_0.6b", "model.intermediate_size=512",
                  "parallelism.tensor_parallel_degree=4", "parallelism.data_parallel_shard_degree=16",
                  "training.global_batch_size=16", "training.local_batch_size=1"], 6),
    "qwen3_moe_ep": ([*QWEN3_SMALL, "model=qwen3_30b_a3b", "model.moe_hidden_dim=64",
                      "parallelism.data_parallel_shard_degree=64", "parallelism.expert_parallel_degree=8",
                      "training.global_batch_size=64", "training.local_batch_size=1"], 8),
}


# fsdp is quick; tp and pp are slow, their mesh dims built in 3d's and tp_moe's ranks too
MARKS = {"fsdp": pytest.mark.quick, "tp": pytest.mark.slow, "pp": pytest.mark.slow}


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, ())) for n in sorted(LAYOUTS)])
def test_dry_run_of_one_rank_at_world_64(tmp_path, name):
    overrides, rank = LAYOUTS[name]
    code, summary = run_job([*SMALL_MODEL, *WORLD_64, *overrides, "cluster.dry_run=true",
                             f"cluster.dry_run_rank={rank}"], tmp_path)
    assert code == 0, summary
    report = summary["dry_run"]
    assert (report["rank"], report["world"]) == (rank, 64)
    held, predicted = report["measured"], report["predicted"]
    # AdamW keeps two moments per parameter, gradients mirror the parameters (all fp32 shards).
    assert held["grads"] == held["params"] > 0
    assert held["optimizer"] == pytest.approx(2 * held["params"], rel=0.01)
    # The planner's states for this rank's pipeline position: the shards it holds.
    assert held["states_gib"] == pytest.approx(predicted["states"], rel=0.05)
    assert held["peak_gib"] > held["states_gib"]
    # The step's peak of live tensors: the states, plus what the step gathers and keeps for
    # backward, near what the planner predicts of those (less its fixed runtime).
    assert held["tensor_peak_gib"] > held["states_gib"]
    assert 0.6 < tensor_gib(predicted) / held["tensor_peak_gib"] < 1.6
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert summary["state_bytes_per_rank"] == int(held["states_gib"] * 2**30)


@pytest.mark.parametrize("overrides", [["parallelism.data_parallel_shard_degree=2"],
                                       pytest.param(["model=moe_debug", "parallelism.expert_parallel_degree=2",
                                                     "parallelism.data_parallel_shard_degree=-1"],
                                                    marks=pytest.mark.slow)],  # EP under SAC trains in test_moe
                         ids=["dense_fsdp2", "moe_ep2"])
def test_a_dry_run_under_selective_ac_holds_what_the_memory_model_counts(tmp_path, overrides):
    """Per-op selective AC's saves counted from its policy (perf.model.memory.selective_saved): the
    step's peak of live tensors within 5 % of the planner's, at 8,192 tokens a rank (measured
    2026-12-02: -1 % and +1 %; +43 % and +45 % when a share of 55 % stood for the saves)."""
    code, summary = run_job([*overrides, "cluster.nproc_per_node=2", "activation_checkpoint.mode=selective",
                             "training.seq_len=2048", "training.local_batch_size=4", "cluster.dry_run=true"], tmp_path)
    assert code == 0, summary
    report = summary["dry_run"]
    assert tensor_gib(report["predicted"]) == pytest.approx(report["measured"]["tensor_peak_gib"], rel=0.05)


def test_dry_run_at_world_512_shards_by_512(tmp_path):
    """FSDP 128 x TP 4: the rank holds 1/512 of every parameter, as the planner says. (dim 2048,
    so every local tensor's first dim splits evenly 128 ways: a smaller one gives its first
    ranks a row each and its last ranks none, which the planner's even split does not model.)"""
    code, summary = run_job([*SMALL_MODEL, "model.dim=2048", "model.n_heads=16", "model.n_kv_heads=8",
                             "model.n_layers=2", "cluster.nnodes=64", "cluster.nproc_per_node=8",
                             "parallelism.tensor_parallel_degree=4", "parallelism.data_parallel_shard_degree=128",
                             "training.global_batch_size=128", "training.local_batch_size=1",
                             "cluster.dry_run=true", "cluster.dry_run_rank=511"], tmp_path)
    assert code == 0, summary
    report = summary["dry_run"]
    assert report["layout"] == "dp_shard128 x tp4" and report["world"] == 512
    assert report["measured"]["states_gib"] == pytest.approx(report["predicted"]["states"], rel=0.05)


# What a dry run prints as it goes, in this order, each part when it ends with its seconds.
PHASES = ["torch imported, fake process group up: ", "model built on the meta device: ", "parallelized (dp_shard64): ",
          "weights materialised on cpu and initialised: ", "the rank built (model, optimizer, data): ",
          "step 1 of 2 (makes the optimizer's state, not measured): ", "step 2 of 2 (measured): ", "done: "]


@pytest.mark.parametrize("rank", [pytest.param(0, marks=pytest.mark.quick), 5])
def test_a_dry_run_reports_each_part_as_it_ends_and_its_table_once(tmp_path, rank):
    """Rank 0 or another: the parts' lines in order, each with its seconds, then the table once
    (the launcher's, from the summary), and a TFLOP/s line about the one process, not a share of
    8 ranks per node."""
    out = launch_cli([*SMALL_MODEL, *WORLD_64, *LAYOUTS["fsdp"][0], "cluster.dry_run=true",
                      f"cluster.dry_run_rank={rank}", f"hydra.run.dir={tmp_path}"])
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    at = [text.find(phase) for phase in PHASES]
    assert -1 not in at and at == sorted(at), [p for p, i in zip(PHASES, at) if i == -1] or at
    for phase in PHASES:
        assert re.search(re.escape(phase) + r"\d+\.\d s", text), phase
    assert text.count(f"rank {rank} of 64 (dp_shard64) on cpu, one step:") == 1
    assert text.count("| parameters + gradients + optimizer |") == 1
    assert text.find("step 2 of 2") < text.find("| parameters + gradients + optimizer |")
    assert "rank(s) gets" not in text
    peak = re.search(r"CPU float32 matmul peak (\d+\.\d+) TFLOP/s with \d+ thread\(s\): the rate of the one process "
                     rf"that simulates rank {rank} \(this CPU's, not a GPU's\)", text)
    rank_peak = re.search(r"\| peak ([\d.e+-]+) TFLOP/s \(config\)", text)  # the rank's MFU denominator
    assert peak and rank_peak and float(rank_peak.group(1)) == pytest.approx(float(peak.group(1)), abs=5e-4)


@pytest.mark.quick
def test_dry_run_rank_outside_the_layout_is_refused(tmp_path):
    code, summary = run_job([*SMALL_MODEL, *WORLD_64, "parallelism=fsdp", "training.global_batch_size=64",
                             "training.local_batch_size=1", "cluster.dry_run=true", "cluster.dry_run_rank=64"],
                            tmp_path)
    assert code != 0
    assert summary is None or summary["status"] == "invalid"


def test_a_hardware_file_gives_the_dry_run_its_predicted_step(tmp_path):
    """cluster.hardware: the dry run's report (and the table the launcher prints) adds the layout's
    predicted step and the rank's memory on the file's GPUs, from the file's values: a 0.5 GB/s
    network makes FSDP over 8 nodes slower than the H100 spec sheet's 50 GB/s (each node's 8
    NICs at once), and the device memory is the file's GPU's."""
    from titan_exp.cluster.dry_run import table
    from titan_exp.config import load_job_config
    from titan_exp.perf.model.step import predict_step
    from titan_exp.perf.rates.devices import SPECS, spec_profile
    from titan_exp.perf.rates.hardware import load_hardware

    hw_file = tmp_path / "hw.yaml"
    hw_file.write_text("device: h100\ngpus_per_node: 8\nnetwork_gb_s: 0.5\n")
    overrides, rank = LAYOUTS["fsdp"]
    code, summary = run_job([*SMALL_MODEL, *WORLD_64, *overrides, "cluster.dry_run=true",
                             f"cluster.dry_run_rank={rank}", f"cluster.hardware={hw_file}"], tmp_path / "run")
    assert code == 0, summary
    report = summary["dry_run"]["hardware"]
    job = load_job_config(tmp_path / "run" / "config.yaml")
    own = predict_step(job, spec_profile(load_hardware(hw_file).spec, 64, 8), cuda=True).step_s
    sheet = predict_step(job, spec_profile(SPECS["h100"], 64, 8), cuda=True).step_s
    assert report["step_s"] == pytest.approx(own) and own > 1.5 * sheet
    assert report["breakdown_s"]["exposed_comm"] > 0 and report["device_memory_gib"] == SPECS["h100"].memory_gib
    assert report["fits"] and 0 < report["memory_gib"] < report["device_memory_gib"]
    printed = table(summary["dry_run"])
    assert f"hardware from {hw_file}: device h100, gpus_per_node 8, network_gb_s 0.5" in printed
    assert "predicted on h100 (cluster.hardware): " in printed and "s/step" in printed


def test_a_pipelines_last_stage_keeps_no_microbatchs_logits(tmp_path):
    """The last stage of a 2-stage pipeline over 8 microbatches at a 32k vocabulary: each
    microbatch's logits (32 MiB in fp32) live only through its loss. Were they kept to the end of the
    step (torch's schedules do, to return them, unless told not to), the peak would hold eight; the
    planner's count, which has one, is within 10 % of the measured peak."""
    code, summary = run_job(["model.n_layers=2", "model.vocab_size=32768", "training.seq_len=256",
                             "parallelism.pipeline_parallel_degree=2",
                             "parallelism.pipeline_parallel_microbatch_size=1", "training.local_batch_size=8",
                             "training.global_batch_size=8",
                             "cluster.nproc_per_node=2", "cluster.dry_run=true", "cluster.dry_run_rank=1"], tmp_path)
    assert code == 0, summary
    report = summary["dry_run"]
    assert tensor_gib(report["predicted"]) == pytest.approx(report["measured"]["tensor_peak_gib"], rel=0.10)
