"""How the validation against published GPU runs scores (benchmarks/published): its fit's search, the
pairs and orders it counts, repeats of one configuration, and what two GPUs' recipes differed in.
Small rows made here; nothing is predicted."""

from __future__ import annotations

import functools

import pytest

from benchmarks.published import fit, predict, report, rows, scoring


@functools.cache
def first() -> rows.Row:
    return rows.read_rows()[0]


def with_cells(row: rows.Row, label: str, **cells: str) -> rows.Row:
    """`row` under another label, with these cells changed."""
    return rows.Row(row.source, cells.get("table", row.table), label, {**row.cells, **cells})


def test_the_fits_search_finds_the_minimum_anywhere_in_its_range_one_evaluation_a_step():
    calls = []
    for best in (0.31, 1.2345, 2.99):
        found = fit.golden_section(lambda x: calls.append(x) or abs(x - best), 0.3, 3.0, 1e-6)  # noqa: B023
        assert abs(found - best) < 1e-6
    assert len(calls) == 3 * 33


def test_a_configuration_published_twice_is_a_repeat_unless_footnoted():
    """One configuration in two tables, 3x apart: no prediction is within 50 % of both. A row its
    table footnotes as a known regression repeats nothing."""
    again = with_cells(first(), first().label, table="a later release",
                       tokens_per_s_per_gpu=str(3 * first().num("tokens_per_s_per_gpu")))
    said = scoring.repeats([first(), again])
    assert "1 configurations, 2 rows" in said and "within 50 % of both" in said
    assert scoring.repeats([first()]) == "no configuration is published twice"
    footnoted = with_cells(again, again.label, note="source footnote: a known performance regression")
    assert scoring.repeats([first(), footnoted]) == "no configuration is published twice"


def planned(*rows_: rows.Row) -> list[rows.Planned]:
    return [rows.Planned(r, None, None) for r in rows_]


def test_pairs_on_one_machine_are_ordered_as_published_or_not():
    faster = with_cells(first(), "faster", tokens_per_s_per_gpu=str(2 * first().num("tokens_per_s_per_gpu")))
    elsewhere = with_cells(first(), "elsewhere", gpus="512")  # another machine: no pair
    three = planned(first(), faster, elsewhere)
    assert scoring.machine_pairs(list(zip(three, (1.0, 2.0, 9.0)))) == (1, 1)
    assert scoring.machine_pairs(list(zip(three, (2.0, 1.0, 0.5)))) == (0, 1)


def test_a_table_out_of_order_is_named_by_what_tells_the_swapped_rows_apart():
    faster = with_cells(first(), "faster", tokens_per_s_per_gpu=str(2 * first().num("tokens_per_s_per_gpu")))
    other_gpu = with_cells(faster, "other GPU", gpu="gb300")
    swapped = planned(first(), other_gpu)
    assert scoring.swapped_pairs({"t": list(zip(swapped, (2.0, 1.0)))}) == {f"gb300 over {first()['gpu']}": 1}
    assert scoring.swapped_pairs({"t": list(zip(swapped, (1.0, 2.0)))}) == {}
    assert scoring.swapped_pairs({"t": list(zip(planned(first(), faster), (2.0, 1.0)))}) == {
        "two layouts of one model on one GPU": 1}


def test_one_configuration_on_two_gpus_is_compared_published_and_predicted():
    """The later-named GPU's tokens/s over the other's; rows that differ in anything but the GPU are
    no such pair."""
    other_gpu = with_cells(first(), "other GPU", gpu="gb300",
                           tokens_per_s_per_gpu=str(2 * first().num("tokens_per_s_per_gpu")))
    later, earlier = sorted((first()["gpu"], "gb300"), reverse=True)
    ratio = 2.0 if later == "gb300" else 0.5
    assert scoring.gpu_pairs(list(zip(planned(first(), other_gpu), (3.0, 3.0)))) == (
        f"{later} over {earlier}, 1 configuration: published {ratio:.2f} ({ratio:.2f}-{ratio:.2f}), "
        "predicted 1.00 (1.00-1.00)")
    wider = with_cells(other_gpu, "wider", gpus="512")
    assert scoring.gpu_pairs(list(zip(planned(first(), wider), (1.0, 1.0)))) == ""


def megatron_bridge(model: str, table: str) -> dict[str, rows.Row]:
    return {r["gpu"]: r for r in rows.read_rows() if r.source == "megatron_bridge" and r["model"] == model
            and r.table.startswith(table) and r["fsdp"] == "true"}


def test_what_two_gpus_recipes_of_one_configuration_differ_in():
    """Llama 3 70B under FSDP on GB300 and GB200 offloads 20 and 40 blocks' activations to the CPU."""
    fsdp70 = megatron_bridge("llama3_70b", "26.04 ")
    assert scoring.recipe_differences(fsdp70["gb300"], fsdp70["gb200"]) == {"cpu_offloading_num_layers": ("20", "40")}
    assert scoring.recipe_differences(fsdp70["gb300"], fsdp70["gb300"]) == {} == scoring.recipe_differences(
        first(), first())


def test_moe_rows_are_grouped_by_what_their_recipe_ran():
    mb = [p for p in predict.plan_rows(rows.read_rows()) if p.row.source == "megatron_bridge" and p.job is not None]
    qwen = {(p.row.table.split()[0], p.row["gpu"]): p for p in mb if p.row["model"] == "qwen3_30b_a3b"}
    groups = report.recipe_groups([(qwen[("26.06", "gb200")], 0.0, -0.3), (qwen[("25.11", "b200")], 0.0, 1.5),
                                   (qwen[("26.04", "b200")], 0.0, -0.02)])
    assert groups == ("one CUDA graph a step, FP8 attention, all-to-all overlapped, fused grouped MLP (v0.5.0 on): "
                      "1 rows, median -30 %; NCCL's all-to-all (alltoall dispatcher): 1 rows, median +150 %; "
                      "HybridEP's dispatch: 1 rows, median -2 %")


@pytest.mark.parametrize("x, printed", [(0.125, 0.12), (0.135, 0.14), (-0.024, -0.02), (0.3, 0.3)])
def test_the_record_rounds_as_the_report_prints(x, printed):
    assert report.percent(x) == printed
