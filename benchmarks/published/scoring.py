"""How the GPU model's predictions of published rows are scored beyond their errors (issue 36), for
benchmarks/published: each technique's published effect against the predicted one
(`effects`), the order of a table's rows (`machine_pairs`, `swapped_pairs`), one configuration
published on two GPUs (`gpu_pairs`), how far one configuration's measurements published twice
lie apart (`repeats`), and the held-out rows by spec sheet (`by_device`)."""

from __future__ import annotations

import statistics
from collections import Counter

from titan_exp.perf.calibration.fit import median_abs

from .jobs import GPUS
from .rows import Planned, Row, known_regression, published, recipe, scaling

TECHNIQUES = {"compile": lambda r: r["compile"], "precision": scaling,
              "async TP": lambda r: r["async_tp"], "activation checkpointing": lambda r: r["activation_checkpointing"],
              "pipeline schedule": lambda r: (r["pp_schedule"], r["vp"])}
# Issue 36's target for each technique's predicted effect: within this many percentage points.
EFFECT_POINTS = 5
SAME = ("gpu", "gpus", "model", "tp", "pp", "cp", "dp", "seq_len", "global_batch", "local_batch", "micro_batch")


def context_parallel_pair(a: Row, b: Row) -> bool:
    """Whether two rows are context parallelism's published experiment: the same GPUs and technique,
    the sequence grown with the CP degree (each rank's share of it the same), its ranks taken from
    FSDP's (TorchTitan's Tables 2 and 6)."""
    def share(r: Row) -> tuple[float, float] | None:
        stated = r.num("seq_len"), r.num("dp")
        return None if None in stated else (stated[0] / r.num("cp", 1), stated[1] * r.num("cp", 1))
    rest = [k for k in SAME if k not in ("cp", "dp", "seq_len")]
    return (a["cp"] != b["cp"] and all(a[k] == b[k] for k in rest) and share(a) is not None
            and share(a) == share(b) and all(f(a) == f(b) for f in TECHNIQUES.values()))


def effects(scored: list[tuple[Planned, float]]) -> list[tuple[str, str, float, float]]:
    """(technique, pair, published ratio, predicted ratio) for pairs of rows of one table that
    differ in that technique alone, and for context parallelism, pairs of its weak scaling over the
    sequence (context_parallel_pair; one step of the CP degree, not every pair)."""
    out = []
    for i, (a, pa) in enumerate(scored):
        for b, pb in scored[i + 1:]:
            ra, rb = a.row, b.row
            if ra.source != rb.source or ra.table != rb.table:
                continue
            if any(ra[k] != rb[k] for k in SAME):
                differ = (["context parallel"] if context_parallel_pair(ra, rb)
                          and rb.num("cp", 1) == 2 * ra.num("cp", 1) else [])
            else:
                differ = [t for t, f in TECHNIQUES.items() if f(ra) != f(rb)]
            if len(differ) == 1:
                pair = f"{' '.join(ra.table.split()[:2])}: {ra.label} -> {rb.label}"
                out.append((differ[0], pair, published(rb)[1] / published(ra)[1], pb / pa))
    return out


ONE_MACHINE = ("model", "gpu", "gpus")


def machine_pairs(scored: list[tuple[Planned, float]]) -> tuple[int, int]:
    """(ordered, all): the pairs of rows of one table that ran one model on one machine (another
    layout or technique; published ties left out) whose predictions order them as published,
    which is the planner's question on a user's machine."""
    pairs = [(a, pa, b, pb) for i, (a, pa) in enumerate(scored) for b, pb in scored[i + 1:]
             if a.row.table == b.row.table and all(a.row[k] == b.row[k] for k in ONE_MACHINE)
             and published(a.row)[1] != published(b.row)[1]]
    return sum((published(a.row)[1] - published(b.row)[1]) * (pa - pb) > 0 for a, pa, b, pb in pairs), len(pairs)


def swapped_pairs(tables: dict[str, list[tuple[Planned, float]]]) -> Counter:
    """The tables whose predictions do not keep the published order, by the pairs of rows they
    swap, each named for what tells its rows apart: two GPUs ("gb300 over gb200", the published
    faster first), two models on one GPU, or two layouts (or techniques) of one model on one GPU."""
    def kind(a: Planned, b: Planned) -> str:
        if a.row["gpu"] != b.row["gpu"]:
            return f"{a.row['gpu']} over {b.row['gpu']}"
        return "two models on one GPU" if a.row["model"] != b.row["model"] else "two layouts of one model on one GPU"

    out: Counter = Counter()
    for rows in tables.values():
        swapped = {kind(*((a, b) if published(a.row)[1] > published(b.row)[1] else (b, a)))
                   for i, (a, pa) in enumerate(rows) for b, pb in rows[i + 1:]
                   if (published(a.row)[1] - published(b.row)[1]) * (pa - pb) < 0}
        if swapped:
            out[" and ".join(sorted(swapped))] += 1
    return out


# What a row publishes or says of itself, not what it ran: rows alike in every other column ran one
# configuration (in different tables: a source's releases).
NOT_CONFIGURATION = {"source_repo", "source_path", "source_commit", "table", "row_label", "tokens_per_s_per_gpu",
                     "tflops_per_gpu", "mfu", "memory_gib", "derived", "note", "dtype", "fp8_recipe"}


def configuration(row: Row, beside: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """What `row` ran: its precision (rows.scaling) and its cells but what it publishes or
    says of itself (NOT_CONFIGURATION) and the columns named `beside`."""
    return (scaling(row), *(v for k, v in row.cells.items() if k not in NOT_CONFIGURATION and k not in beside))


GPU_COLUMNS = frozenset({"gpu", "gpus_per_node"})  # what sets one GPU apart from another in a row
# What Megatron-Bridge's scripts set per GPU beyond a table's columns (RECIPES), which can differ
# between two GPUs' runs of one configuration. Of them the model prices only EP's all-to-all overlap
# where the whole step is one CUDA graph (predict.ep_overlapped).
RECIPE_FIELDS = ("cpu_offloading_num_layers", "recompute_modules", "cuda_graph_impl", "cuda_graph_scope", "dispatcher",
                 "moe_a2a_overlap", "fp8_attention", "fused_grouped_mlp")


def recipe_differences(a: Row, b: Row) -> dict[str, tuple[str, str]]:
    """The RECIPE_FIELDS whose values differ between two rows' recipes (each value up to its
    parenthesized gloss: "none (unset)" is "none (recipe default)"); none where either has no recipe."""
    ra, rb = recipe(a), recipe(b)
    if not ra or not rb:
        return {}
    values = {field: (ra[field].split(" (")[0], rb[field].split(" (")[0]) for field in RECIPE_FIELDS}
    return {field: pair for field, pair in values.items() if pair[0] != pair[1]}


def gpu_pairs(scored: list[tuple[Planned, float]]) -> str:
    """One configuration published on two GPUs in one table (every column alike but the GPU's):
    per pair of GPUs (the later name first: gb300 over gb200), how many such pairs, the first GPU's
    tokens/s over the second's, published against predicted (median and range), and where the two
    runs' recipes differ (recipe_differences: the first GPU's value against the second's, with how
    many configurations). What separates the runs that the model's parts do not, where table
    order fails across GPUs."""
    ratios: dict[tuple[str, str], list[tuple[float, float]]] = {}
    differ: dict[tuple[str, str], Counter] = {}
    for i, (a, pa) in enumerate(scored):
        for b, pb in scored[i + 1:]:
            ra, rb = a.row, b.row
            if ra.table != rb.table or ra["gpu"] == rb["gpu"] or (configuration(ra, GPU_COLUMNS)
                                                                 != configuration(rb, GPU_COLUMNS)):
                continue
            (hi, phi), (lo, plo) = sorted(((ra, pa), (rb, pb)), key=lambda x: x[0]["gpu"], reverse=True)
            ratios.setdefault((hi["gpu"], lo["gpu"]), []).append((published(hi)[1] / published(lo)[1], phi / plo))
            differ.setdefault((hi["gpu"], lo["gpu"]), Counter()).update(
                f"{field} {x} vs {y}" for field, (x, y) in recipe_differences(hi, lo).items())

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    def recipes(pair: tuple[str, str]) -> str:
        counted = differ[pair]
        return (", their recipes differing in " + ", ".join(f"{what} ({n})" for what, n in sorted(counted.items()))
                if counted else "")
    return "; ".join(f"{hi} over {lo}, {len(v)} configuration{'s' if len(v) > 1 else ''}: published "
                     f"{spread([x for x, _ in v])}, predicted {spread([y for _, y in v])}{recipes((hi, lo))}"
                     for (hi, lo), v in sorted(ratios.items(), key=lambda kv: -len(kv[1])))


def repeats(rows: list[Row]) -> str:
    """How far one configuration's measurements published in several tables lie apart: the floor
    under any model's worst error on them (a prediction p is within (max - min) / (max + min) of
    both ends at best, at p = 2 max min / (max + min)). A row its source footnotes as a known
    regression ran another engine in effect, and is not a repeat."""
    runs: dict[tuple, list[tuple[float, Row]]] = {}
    for r in rows:
        if (r["tokens_per_s_per_gpu"] or r["mfu"] or r["tflops_per_gpu"]) and not known_regression(r):
            unit, value = published(r)
            runs.setdefault((unit, *configuration(r)), []).append((value, r))
    again = [sorted(v, key=lambda x: x[0]) for v in runs.values() if len({r.table for _, r in v}) > 1]
    if not again:
        return "no configuration is published twice"
    spreads = [(v[-1][0] / v[0][0], v) for v in again]
    widest, v = max(spreads, key=lambda x: x[0])
    (low, a), (high, _) = v[0], v[-1]
    return (f"published in more than one table (a source's releases): {len(again)} configurations, "
            f"{sum(map(len, again))} rows; fastest over slowest median {statistics.median(s for s, _ in spreads):.2f}, "
            f"widest {widest:.2f} ({a.source} {a['model']} on {a['gpus']} {a['gpu']}: {low:,.0f} to {high:,.0f} "
            f"{published(a)[0]}), where no prediction is within {100 * (high - low) / (high + low):.0f} % of both")


def by_device(listed: list[tuple[Planned, float, float]]) -> dict[str, tuple[int, float, float]]:
    """The held-out rows by the spec sheet they were planned on (perf.rates.devices.SPECS' name), most
    rows first: (rows, median signed error, median |error|). A spec sheet's plan quotes its own
    (perf.rates.accuracy.published's "by_device")."""
    errs: dict[str, list[float]] = {}
    for p, _, e in listed:
        errs.setdefault(GPUS[p.row["gpu"]], []).append(e)
    return {name: (len(v), statistics.median(v), median_abs(v))
            for name, v in sorted(errs.items(), key=lambda kv: (-len(kv[1]), kv[0]))}
