"""The validation against published GPU runs (benchmarks/published), row by row: each published row
is the job it describes, with the model cards' parameter counts, the layout it ran and the engine its
source ran; which rows are held out, fitted on or moved out of the scores. No prediction is scored
here (test_published_report.py runs the command)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from benchmarks.published import engines, fit, jobs, megatron, predict, rows
from titan_exp.perf.rates.devices import Efficiency


@functools.cache
def planned() -> tuple[rows.Planned, ...]:
    return tuple(predict.plan_rows(rows.read_rows()))


def of(source: str) -> list[rows.Planned]:
    return [p for p in planned() if p.row.source == source and p.job is not None]


def test_every_row_is_planned_or_refused_with_its_reason():
    assert not [p.why_not for p in planned() if p.why_not and p.why_not.startswith("not built")]
    assert len(of("torchtitan")) == 18


def test_mpt_rows_have_the_published_parameter_counts():
    """An MPT row's job has the published parameter count, less its learned position embedding."""
    mpt = of("llm_foundry")
    assert len(mpt) >= 100
    for p in mpt:
        published = p.row.num("params_b") * 1e9 - p.job.training.seq_len * p.job.model.dim
        assert p.job.model.num_params == pytest.approx(published, rel=2e-3), p.row.key


def test_moe_rows_have_the_model_cards_parameters_and_the_rows_ep():
    """Qwen3's MoE rows: heads 128 wide and routed experts give the model cards' total and active
    parameters; GPT-OSS 120B's active count is the card's without the embedding table."""
    moe = {p.row["model"]: p for p in planned() if jobs.is_moe(p.row) and p.job is not None}
    for name, (total, active) in {"qwen3_30b_a3b": (30.5e9, 3.3e9), "qwen3_235b_a22b": (235e9, 22e9)}.items():
        m = moe[name].job.model
        assert m.num_params == pytest.approx(total, rel=0.01) and m.active_params == pytest.approx(active, rel=0.03)
        assert moe[name].job.parallelism.expert_parallel_degree == int(moe[name].row.num("ep"))
    m = moe["gpt_oss_120b"].job.model
    assert m.num_params == pytest.approx(116.8e9, rel=0.01)
    assert m.active_params - m.vocab_size * m.dim == pytest.approx(5.13e9, rel=0.01)


def test_an_moe_row_without_fsdp_is_hsdp_over_its_ep_groups():
    """Megatron's data parallel without FSDP, in an MoE row: HSDP over the EP groups (a group takes
    TP's ranks too where TP > 1), so nothing crosses nodes each microbatch that Megatron's
    distributed optimizer moves once a step."""
    hsdp = [p for p in planned() if p.job is not None and jobs.moe_replicas(p.row) > 1]
    assert hsdp
    for p in hsdp:
        par = p.job.parallelism
        assert par.data_parallel_shard_degree * par.context_parallel_degree * par.tensor_parallel_degree == \
            par.expert_parallel_degree
        assert par.data_parallel_replicate_degree == jobs.moe_replicas(p.row)


def pp16(row: rows.Row) -> bool:
    """DeepSeek-V3 at PP 16 without VP on B200s or B300s: its last stage holds one block, the
    multi-token prediction layer and the loss."""
    return (row["model"], row["pp"], row["vp"] in ("", "1"), row["gpu"] in ("b200", "b300")) == (
        "deepseek_v3", "16", True, True)


def test_which_rows_were_moved_out_of_the_scores():
    """MLA's rows, planned after the others were examined, moved only where a later change was made
    for them (the second pass through the output head, EP's overlap); 25.09's, planned after every
    move, never. Moved dense rows fit; moved MoE rows stay out of the fit, as every MoE row does."""
    hsdp = [p for p in planned() if p.job is not None and jobs.moe_replicas(p.row) > 1]
    assert all(bool(fit.moved(p.row)) == (not jobs.unstated_precision(p.row) and (
        p.row["model"] not in jobs.MLA_MODELS or pp16(p.row) or predict.ep_overlapped(p.row))) for p in hsdp)
    fitting = fit.fitting_set(list(planned()))
    moved = [p for p in planned() if p.job is not None and fit.moved(p.row)]
    assert not [p for p in fitting if jobs.is_moe(p.row)]
    assert moved and all((p in fitting) != jobs.is_moe(p.row) for p in moved)
    assert all(any(which(p.row) for p in planned()) for _, which in fit.MOVED_TO_FIT)  # each names rows that exist
    torchtitan_table_1 = {p.row.key for p in planned()
                          if p.row.source == "torchtitan" and p.row.table.startswith("Table 1")}
    assert {p.row.key for p in fitting} >= torchtitan_table_1
    derived = [p for p in planned() if p.row["derived"] == "true"]  # layouts the sources do not state as run
    assert len(derived) == 4 and all(p.job is not None and fit.moved(p.row) for p in derived)
    assert {(p.job.parallelism.tensor_parallel_degree, p.job.parallelism.pipeline_parallel_degree,
             p.job.parallelism.pipeline_parallel_stages_per_rank, p.job.parallelism.expert_parallel_degree)
            for p in derived} == {(8, 6, 1, 1), (1, 4, 5, 1), (1, 1, None, 16)}  # None: no pipeline
    regressed = [p for p in planned() if rows.known_regression(p.row)]  # footnoted: scored nowhere
    assert len(regressed) == 2 and all(p.job is not None and fit.moved(p.row) for p in regressed)


def test_the_planners_compute_scale_is_the_fit():
    """The GPU path's one fitted constant (Efficiency.compute_scale) is what the fitting set gives."""
    fitting = fit.fitting_set(list(planned()))
    assert fit.fit(fitting).compute_scale == pytest.approx(Efficiency().compute_scale, abs=1e-3)


def test_the_engines_each_source_ran():
    """MPT's own memory-bound kernels, not Llama's, are priced for LLM Foundry's rows; Transformer
    Engine's TP overlap is priced as async TP on every Megatron-Bridge row with TP."""
    eff, mpt = Efficiency(), of("llm_foundry")[:5]
    with_mpt = [predict.predict(p, eff) for p in mpt]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(predict, "elementwise", lambda row: engines.TORCHTITAN_LLAMA)
        assert all(a > 1.02 * b for a, b in zip(with_mpt, (predict.predict(p, eff) for p in mpt)))
    assert engines.ENGINES["megatron_bridge"].overlaps_tp and not engines.ENGINES["torchtitan"].overlaps_tp
    assert all(p.job.parallelism.enable_async_tensor_parallel == (int(p.row.num("tp", 1)) > 1)
               for p in of("megatron_bridge"))


def test_a_machines_profile_is_built_once_and_scaled_as_spec_profile_would():
    scaled, h100 = Efficiency(compute_scale=1.7, nvlink=0.7), predict.SPECS["h100"]
    shared, own = predict.machine(h100, 16, 8, scaled, "flash"), predict.spec_profile(h100, 16, 8, scaled, "flash")
    assert dataclasses.replace(shared, created="", notes=[]) == dataclasses.replace(own, created="", notes=[])


def test_ep_overlap_is_priced_where_the_dispatch_never_waits_for_the_host():
    """EP's all-to-alls overlapped with another microbatch's compute where the recipe sets it and the
    step is one CUDA graph (the 26.06 tables on), not where it sets it with a dropless dispatch."""
    pairing = [p for p in planned() if p.job is not None
               and (rows.recipe(p.row) or {}).get("moe_a2a_overlap", "").startswith("true")]
    overlapped = {p.row.table.split()[0] for p in pairing if predict.ep_overlapped(p.row)}
    assert len(pairing) == 39 and overlapped == {"26.06", "26.06.01", "26.08"}
    assert sum(map(predict.ep_overlapped, (p.row for p in pairing))) == 26


def test_mla_rows_have_their_shapes_output_heads_and_pipeline_ends():
    """DeepSeek-V3 with its multi-token-prediction layer as one more block and a second pass through
    the output head, Kimi K2 without; pipelines as their recipes' layout strings place the blocks."""
    mla = [p for p in planned() if p.row["model"] in jobs.MLA_MODELS]
    assert len(mla) == 39 and sum(pp16(p.row) for p in mla if fit.moved(p.row) and p.job is not None) == 7
    assert (megatron.output_heads("deepseek_v3"), megatron.output_heads("kimi_k2")) == (2, 1)
    shapes = {p.row["model"]: p.job.model for p in mla if p.job is not None}
    assert shapes["deepseek_v3"].mla and shapes["deepseek_v3"].n_layers == 62
    assert shapes["deepseek_v3"].num_params == pytest.approx(671.03e9 + shapes["deepseek_v3"].block_params, rel=1e-3)
    assert shapes["kimi_k2"].num_params == pytest.approx(1.026e12, rel=1e-3)
    assert shapes["kimi_k2"].active_params == pytest.approx(32.86e9, rel=1e-3)
    ends = {(p.row["model"], p.row["gpu"], p.row.table.split()[0]): (
        p.job.parallelism.pipeline_parallel_first_stage_less_layers,
        p.job.parallelism.pipeline_parallel_last_stage_less_layers)
        for p in mla if p.job is not None}
    assert ends[("deepseek_v3", "gb300", "26.08")] == (0, 2)  # Et*4|(t*4|)*14tmL over PP 2 x VP 8
    assert ends[("kimi_k2", "gb300", "26.06")] == (0, 3)  # Et*4|(t*4|)*14tL
    assert ends[("deepseek_v3", "gb300", "25.11")] == (0, 0)  # its recipe's 16 stages, not the table's PP 2 x VP 4


def test_rows_without_a_printed_precision_take_their_recipes():
    """Megatron-Bridge's 25.09 tables print no precision: torchao's tensorwise float8 for the values as
    printed, MXFP8 for those in parentheses, all held out. Refused: DeepSeek-V3's H100 row in
    parentheses (DeepSeek's blockwise FP8) and its GB200 one (EP 64 over PP 8's 32 data-parallel
    ranks); a row of a release whose recipes were not read is refused, not guessed."""
    fresh = [p for p in planned() if jobs.unstated_precision(p.row)]
    fitted = fit.fitting_set(list(planned()))
    assert len(fresh) == 28 and not [p for p in fresh if p in fitted or fit.moved(p.row)]
    assert {(p.row.label.endswith("[parenthesized values]"), p.job.precision.name) for p in fresh if p.job} == {
        (False, "float8"), (True, "mxfp8")}
    assert sorted(str(p.why_not)[:55] for p in fresh if p.job is None) == [
        "float8 recipe fp8_blockwise: not one of torchao's here",
        "refused: parallelism.expert_parallel_degree = 64: is ca"]
    mla_refused = {p.row.key for p in planned() if p.row["model"] in jobs.MLA_MODELS and p.job is None}
    assert mla_refused == {p.row.key for p in fresh if p.job is None}
    unread = rows.Row(fresh[0].row.source, "25.07 a release whose recipes were not read", "a row", fresh[0].row.cells)
    assert jobs.skip_reason(unread) == "precision not stated, and no recipe for it"


def test_every_megatron_bridge_row_has_its_releases_recipe():
    mb = of("megatron_bridge")
    assert all(rows.recipe(p.row) for p in mb)
    assert not [p for p in planned() if rows.recipe(p.row) and p.row.source != "megatron_bridge"]
