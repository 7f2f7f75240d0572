"""The GPU model against public measurements (issue 36): TorchTitan's published H100 tables plan
for CUDA and bench_torchtitan.py runs to its summary; XLA's GEMMs and collectives beside the parts
that price them; every published row bench_published.py reads is the job it describes, scored
leave-one-source-out, and what a spec sheet's plan quotes of its accuracy is what that bench
prints. The numbers are in BENCHMARKS.md."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from conftest import REPO, job_config
from titan_exp.perf.devices import SPEC_ACCURACY, SPECS, spec_profile
from titan_exp.validation import validate


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
    # Megatron's data parallel without FSDP, in an MoE row: HSDP over the EP groups (moe_replicas; a group
    # takes TP's ranks too where TP > 1, as Megatron's expert grid does with expert TP 1), so nothing crosses
    # nodes each microbatch that Megatron's distributed optimizer moves once a step.
    hsdp = [p for p in planned if p.job is not None and bench.moe_replicas(p.row) > 1]
    assert hsdp and all(p.job.parallelism.data_parallel_shard_degree * p.job.parallelism.context_parallel_degree
                        * p.job.parallelism.tensor_parallel_degree == p.job.parallelism.expert_parallel_degree
                        and p.job.parallelism.data_parallel_replicate_degree == bench.moe_replicas(p.row) for p in hsdp)
    # examined, so moved out of the held-out scores; MLA's rows, planned after, only where the multi-token
    # prediction layer's pass through the output head was priced for them (PP 16 without VP on B200s, B300s),
    # or EP's overlap with another microbatch's compute (ep_overlapped); 25.09's, planned after every move, never
    pp16 = lambda row: (row["model"], row["pp"], row["vp"] in ("", "1"), row["gpu"] in ("b200", "b300")) == (  # noqa: E731
        "deepseek_v3", "16", True, True)
    assert all(bool(bench.moved(p.row)) == (not bench.unstated_precision(p.row) and (
        p.row["model"] not in bench.MLA_MODELS or pp16(p.row) or bench.ep_overlapped(p.row))) for p in hsdp)
    eff = Efficiency()
    # A machine's profile is built once (bench.machine) and takes each fitted compute_scale as spec_profile would.
    scaled, h100 = dataclasses.replace(eff, compute_scale=1.7, nvlink=0.7), bench.SPECS["h100"]
    shared, own = bench.machine(h100, 16, 8, scaled, "flash"), bench.spec_profile(h100, 16, 8, scaled, "flash")
    assert dataclasses.replace(shared, created="", notes=[]) == dataclasses.replace(own, created="", notes=[])
    calls = []  # the fit's search: one evaluation a step, to within its tolerance, wherever the minimum lies
    for best in (0.31, 1.2345, 2.99):
        found = bench.golden_section(lambda x: calls.append(x) or abs(x - best), 0.3, 3.0, 1e-6)  # noqa: B023
        assert abs(found - best) < 1e-6
    assert len(calls) == 3 * 33
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
    # moved since, all planned but two of 25.09's (below); DeepSeek-V3 with its multi-
    # token-prediction layer as one more block (671B and one MoE block's 11.5B) and a second pass through
    # the output head, Kimi K2 without (1.03T, 32.9B active); their pipelines as their recipes' layout
    # strings place the blocks where those have the row's stages.
    # EP's all-to-alls overlapped with another microbatch's compute where the recipe sets it and its
    # dispatch never waits for the host (the step one CUDA graph: v0.5.0's 26.06 tables on), not
    # where it sets it with a dropless dispatch (13 rows of earlier tables, 25.09's H100 DeepSeek-V3 among them)
    pairing = [p for p in planned if p.job is not None
               and (bench.recipe(p.row) or {}).get("moe_a2a_overlap", "").startswith("true")]
    overlapped = {p.row.table.split()[0] for p in pairing if bench.ep_overlapped(p.row)}
    assert len(pairing) == 39 and overlapped == {"26.06", "26.06.01", "26.08"}
    assert sum(map(bench.ep_overlapped, (p.row for p in pairing))) == 26
    mla = [p for p in planned if p.row["model"] in bench.MLA_MODELS]
    assert len(mla) == 39 and sum(pp16(p.row) for p in mla if bench.moved(p.row) and p.job is not None) == 7
    assert (megatron.output_heads("deepseek_v3"), megatron.output_heads("kimi_k2")) == (2, 1)
    # Megatron-Bridge's 25.09 rows, whose tables print no precision: planned since 2026-12-03 at what their
    # recipes ran, torchao's tensorwise float8 for the values as printed (per-tensor FP8), MXFP8 for those in
    # parentheses (the footnote's 32 x 32 blocks); held out: none fitted on, none moved by an earlier change.
    # Not planned: DeepSeek-V3's H100 row in parentheses (DeepSeek's blockwise FP8) and its GB200 one (the
    # printed EP 64 over PP 8's 32 data-parallel ranks, which no layout composes).
    fresh = [p for p in planned if bench.unstated_precision(p.row)]
    fitted = bench.fitting_set(planned)
    assert len(fresh) == 28 and not [p for p in fresh if p in fitted or bench.moved(p.row)]
    assert {(p.row.label.endswith("[parenthesized values]"), p.job.precision.name) for p in fresh if p.job} == {
        (False, "float8"), (True, "mxfp8")}
    assert sorted(str(p.why_not)[:55] for p in fresh if p.job is None) == [
        "float8 recipe fp8_blockwise: not one of torchao's here",
        "refused: parallelism.expert_parallel_degree = 64: is ca"]
    assert {p.row.key for p in mla if p.job is None} == {p.row.key for p in fresh if p.job is None}
    unread = bench.Row(fresh[0].row.source, "25.07 a release whose recipes were not read", "a row", fresh[0].row.cells)
    assert bench.skip_reason(unread) == "precision not stated, and no recipe for it"  # not guessed
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
    # Where two GPUs' runs of one configuration differ in their recipes: Llama 3 70B under FSDP on
    # GB300 and GB200 offloads 20 and 40 blocks' activations to the CPU (published_recipes.csv).
    from published_scoring import recipe_differences
    fsdp70 = {p.row["gpu"]: p.row for p in mb if p.row.table.startswith("26.04 ") and p.row["model"] == "llama3_70b"
              and p.row["fsdp"] == "true"}
    assert recipe_differences(fsdp70["gb300"], fsdp70["gb200"]) == {"cpu_offloading_num_layers": ("20", "40")}
    assert recipe_differences(fsdp70["gb300"], fsdp70["gb300"]) == {} == recipe_differences(first, first)
    out = subprocess.run([sys.executable, "benchmarks/bench_published.py"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| torchtitan | compute_scale" in out.stdout and "| 5 of 5 | 19 of 19 |" in out.stdout  # every held-out
    # TorchTitan table, every pair on one machine, in order
    # context parallelism's published effect: each doubling of CP and of the sequence (Tables 2 and 6)
    cp = [line for line in out.stdout.splitlines() if "| context parallel |" in line]
    assert len(cp) == 6 and "| Table 2: FSDP 8, CP 1 -> FSDP 4, CP 2 | -35 % |" in cp[0]
    assert "Held-out techniques within 5 points of their published effect: " in out.stdout
    named = next(line for line in out.stdout.splitlines() if line.startswith("Held-out check of Megatron-Bridge's 25.09"))
    assert re.search(r": dense 13 rows, median \|error\| \d+ %, worst [+-]\d+ %; MoE 13 rows, ", named)  # 26 planned
    assert "One configuration on two GPUs in a held-out table (gpu_pairs), the first's tokens/s over the second's: " \
        "gb300 over gb200, 8 configurations: published 1.23 (1.15-1.27)" in out.stdout
    assert "predicted 1.01 (1.00-1.02), their recipes differing in cpu_offloading_num_layers 20 vs 40 (4)" in out.stdout
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
