"""The report of the validation: each source held out in turn, its rows predicted with the
constant fitted on the other sources' fitting rows (fit.py), scored as a table per source, the
checks named before measuring, the techniques' effects, repeats and memory; the last line is the
summary. `--record` writes the accuracy a spec-sheet plan quotes (titan_exp/perf/rates/accuracy.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from dataclasses import dataclass, field

from titan_exp.perf.calibration.fit import median_abs, relative_errors, spearman
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.rates import accuracy
from titan_exp.perf.rates.devices import SPECS, Efficiency

from .engines import ENGINES
from .fit import FITTED, fit, fitting_set, moved
from .jobs import GPUS, MLA_MODELS, ep_over_tp, is_moe, unstated_precision
from .predict import plan_rows, predict
from .rows import RECIPES, Planned, published, read_rows, recipe
from .scoring import EFFECT_POINTS, by_device, effects, gpu_pairs, machine_pairs, repeats, swapped_pairs

SOURCES = ("torchtitan", "megatron_bridge", "llm_foundry", "megatron_lm")


# Named 2026-11-28 at 23:30 UTC, before any row was predicted with it: host time per op by the host's
# CPU (perf.model.block's [host] from this project's five H200 calibrations, an x86 host; times 37.08/13.48
# on a Grace host, TransformerEngine issue 2053's torch Linear forward on GB200 against a Xeon
# 8480C). Predicted: held-out GB200 and GB300 rows whose blocks the host bounds get slower, none
# faster; rows whose every block the GPU bounds move by less than 1 %. No row moves to the
# fitting set for it: reported by `host_check` on every run.
HOST_CHECK = "host time per op by the host's CPU"


# What a Megatron-Bridge MoE row's recipe ran, by the first that applies: from v0.5.0 (26.06) its
# GB200, GB300 and B300 recipes run the whole iteration as one CUDA graph, with FP8 attention, the
# experts' all-to-all overlapped (priced since 2026-11-28: ep_overlapped; the rest is not), a fused
# grouped MLP and the experts padded to 1.5 times their tokens; before, HybridEP's or DeepEP's
# dispatch, or NCCL's all-to-all.
RECIPE_GROUPS = (("one CUDA graph a step, FP8 attention, all-to-all overlapped, fused grouped MLP (v0.5.0 on)",
                  lambda r: r["cuda_graph_impl"] == "full_iteration"),
                 ("HybridEP's dispatch", lambda r: "hybridep" in r["dispatcher"]),
                 ("DeepEP's dispatch", lambda r: "deepep" in r["dispatcher"]),
                 ("NCCL's all-to-all (alltoall dispatcher)", lambda r: r["dispatcher"].startswith("alltoall")))


def recipe_groups(listed) -> str:
    """Megatron-Bridge's held-out MoE rows by what their recipe ran (RECIPE_GROUPS): rows, median
    signed error of each group."""
    groups: dict[str, list[float]] = {}
    for p, _, e in listed:
        rec = recipe(p.row)
        if rec and is_moe(p.row):
            name = next((n for n, f in RECIPE_GROUPS if f(rec)), "other")
            groups.setdefault(name, []).append(e)
    return "; ".join(f"{name}: {len(errs)} rows, median {100 * statistics.median(errs):+.0f} %"
                     for name, errs in groups.items())


def host_check(listed: list[tuple[Planned, float, float]], fits: dict[str, Efficiency]) -> str:
    """HOST_CHECK's outcome: the held-out rows on Grace-hosted GPUs, those whose prediction their
    host moves (against the same GPUs on an x86 host) by more than 0.5 %, which way, and their
    median signed error on each host."""
    grace = [(p, pred, e) for p, pred, e in listed if SPECS[GPUS[p.row["gpu"]]].host_cpu == "grace"]
    moved_by = [(p, e, predict(p, fits[p.row.source], host_cpu="x86") / pred) for p, pred, e in grace]
    moved_by = [(p, e, x86) for p, e, x86 in moved_by if abs(x86 - 1) > 0.005]
    if not moved_by:
        return f"{len(grace)} held-out Grace-hosted rows; the host moves none of them"
    slower = sum(x86 > 1 for _, _, x86 in moved_by)
    on_x86 = statistics.median((1 + e) * x86 - 1 for _, e, x86 in moved_by)
    return (f"{len(grace)} held-out Grace-hosted rows (GB200, GB300); the host moves {len(moved_by)} of them "
            f"({slower} slower, by {100 * min(1 - 1 / x for _, _, x in moved_by):.0f}-"
            f"{100 * max(1 - 1 / x for _, _, x in moved_by):.0f} %): median error {100 * on_x86:+.0f} % on an x86 "
            f"host, {100 * statistics.median(e for _, e, _ in moved_by):+.0f} % on Grace")


@dataclass
class Scores:
    """What the report accumulates over the held-out sources."""

    held_tps: list[float] = field(default_factory=list)
    held_moe: dict[str, list[float]] = field(default_factory=dict)  # each MoE model's rows (MOE_SHAPES)
    held_dense: list[float] = field(default_factory=list)
    effects: list[tuple] = field(default_factory=list)
    listed: list[tuple[Planned, float, float]] = field(default_factory=list)  # (row, prediction, error)
    sources: int = 0
    out_of_order: list[str] = field(default_factory=list)  # swapped_pairs of each source's tables out of order
    pairs: list[tuple[int, int]] = field(default_factory=list)  # each source's (pairs ordered, pairs)


def print_header(planned: list[Planned], ok: list[Planned], fitting: list[Planned]) -> None:
    print(f"{len(planned)} published rows; {len(ok)} planned for CUDA; fitting set: {len(fitting)} rows "
          f"({', '.join(sorted({p.row.source for p in fitting}))})")
    skipped = Counter(f"{p.row.source}: {p.why_not[:110]}" for p in planned if p.job is None)
    for why, n in sorted(skipped.items()):
        print(f"  not planned, {n} row(s): {why}")
    for source, engine in ENGINES.items():
        kernels = ", ".join(f"{kernel} attention on {arch}" for arch, kernel in engine.attention.items())
        print(f"  engine of {source}: {kernels or 'flash attention'}{', elementwise fused' if engine.fused else ''}"
              f"{', TP overlapped' if engine.overlaps_tp else ''} "
              f"({engine.why})")
    for why, n in Counter(moved(p.row) for p in ok if moved(p.row)).items():
        print(f"  moved to the fitting set, not scored, {n} row(s): {why}")


def score_source(source: str, mine: list[Planned], eff: Efficiency, constants: str, scores: Scores) -> None:
    """One held-out source's row of the table, its rows' errors added to `scores`."""
    preds = [(p, predict(p, eff)) for p in mine]
    values = [published(p.row)[1] for p, _ in preds]
    errs = relative_errors([pred for _, pred in preds], values)
    scale = statistics.median(1 + e for e in errs)
    scaled = [(1 + e) / scale - 1 for e in errs]
    tables: dict[str, list[tuple[Planned, float]]] = {}
    for p, pred in preds:
        tables.setdefault(p.row.table, []).append((p, pred))
    ordered = {t: v for t, v in tables.items() if len(v) > 1}
    kept = sum(spearman([published(p.row)[1] for p, _ in v], [b for _, b in v]) > 0.999 for v in ordered.values())
    swaps = swapped_pairs(ordered)
    if swaps:
        scores.out_of_order.append(f"{source}: " + "; ".join(f"{n} swapping {what}" for what, n in swaps.most_common()))
    pairs_kept, pairs = machine_pairs(preds)
    scores.pairs.append((pairs_kept, pairs))
    scores.held_tps += [abs(e) for e in errs]
    for (p, _), e in zip(preds, errs):
        (scores.held_moe.setdefault(p.row["model"], []) if is_moe(p.row) else scores.held_dense).append(abs(e))
    scores.sources += 1
    scores.effects += [(source, *e) for e in effects(preds)]
    scores.listed += [(p, pred, e) for (p, pred), e in zip(preds, errs)]
    print(f"| {source} | {constants} | {len(mine)} | {100 * median_abs(errs):.0f} % "
          f"| {100 * max(errs, key=abs):+.0f} % | {100 * median_abs(scaled):.0f} %, "
          f"{100 * max(scaled, key=abs):+.0f} % | {kept} of {len(ordered)} | {pairs_kept} of {pairs} |")


def print_moe(scores: Scores) -> None:
    """The MoE rows apart from the dense ones, and the subsets named as checks."""
    listed = scores.listed
    every = [e for errs in scores.held_moe.values() for e in errs]
    models = "; ".join(f"{name} {len(errs)}: {100 * median_abs(errs):.0f} %, {100 * max(errs):.0f} %"
                       for name, errs in scores.held_moe.items())
    dense = scores.held_dense
    print(f"\nOf these, MoE rows (expert parallel; MOE_SHAPES): {len(every)}, median |error| "
          f"{100 * median_abs(every):.0f} %, worst {100 * max(every):.0f} % (by model, rows: median, worst: "
          f"{models}); the {len(dense)} dense rows: median {100 * median_abs(dense):.0f} %, "
          f"worst {100 * max(dense):.0f} %")
    print(f"Megatron-Bridge's held-out MoE rows by what their recipe ran ({RECIPES.name}): {recipe_groups(listed)}")
    over = [(p.row, e) for p, _, e in listed if ep_over_tp(p.row)]
    if over:
        print(f"Of them, EP reaching into TP's ranks (ep_over_tp, first planned 2026-11-27): {len(over)} rows: "
              + ", ".join(f"{r['table'].split()[0]} {r['gpu']} {100 * e:+.0f} %" for r, e in over))
    mla = [(p.row, e) for p, _, e in listed if p.row["model"] in MLA_MODELS]
    if mla:
        print(f"Of them, multi-head latent attention (MLA_MODELS, first planned 2026-11-28): {len(mla)} rows, "
              f"median |error| {100 * median_abs([e for _, e in mla]):.0f} %; by what their recipe ran: "
              + recipe_groups([(p, None, e) for p, _, e in listed if p.row["model"] in MLA_MODELS]))


def print_checks(scores: Scores, fits: dict[str, Efficiency]) -> None:
    """The checks named before measuring, and the errors by spec sheet."""
    listed = scores.listed
    print(f"Held-out check of {HOST_CHECK} (named 2026-11-28 before measuring): {host_check(listed, fits)}")
    fresh = {kind: [e for p, _, e in listed if unstated_precision(p.row) and is_moe(p.row) == (kind == "MoE")]
             for kind in ("dense", "MoE")}
    if any(fresh.values()):  # none where Megatron-Bridge is not scored (--source)
        print("Held-out check of Megatron-Bridge's 25.09 rows, at their recipes' precision (unstated_precision; "
              "named 2026-12-03 before any was predicted): " + "; ".join(
                  f"{kind} {len(v)} rows, median |error| {100 * median_abs(v):.0f} %, "
                  f"worst {100 * max(v, key=abs):+.0f} %" for kind, v in fresh.items() if v))
    print("By spec sheet (a plan from one quotes its own: perf.rates.accuracy.published): " + "; ".join(
        f"{name} {n} row{'s' if n > 1 else ''}, median error {100 * signed:+.0f} %, |error| {100 * size:.0f} %"
        for name, (n, signed, size) in by_device(listed).items()))


def print_moved(sources: list[str], ok: list[Planned], fits: dict[str, Efficiency], constants: dict[str, str],
                scores: Scores) -> None:
    """The rows moved to the fitting set, per source, with their effects added to `scores`."""
    print()
    print("| rows moved to the fitting set, per source (not held out: the model was changed, or their layout "
          "derived, for them) | fitted on (others' fitting rows) | rows | median abs error | worst |")
    print("|---|---|---|---|---|")
    for source in sources:
        mine = [p for p in ok if p.row.source == source and moved(p.row)]
        if mine:
            preds = [predict(p, fits[source]) for p in mine]
            errs = relative_errors(preds, [published(p.row)[1] for p in mine])
            scores.effects += [(source, t, f"{pair} (moved to the fitting set)", *r) for t, pair, *r in
                               effects(list(zip(mine, preds)))]
            print(f"| {source} | {constants[source]} | {len(mine)} | {100 * median_abs(errs):.0f} % "
                  f"| {100 * max(errs, key=abs):+.0f} % |")


def print_effects(all_effects: list[tuple]) -> None:
    print()
    print("| source | technique | pair of rows | published effect | predicted | difference (points) |")
    print("|---|---|---|---|---|---|")
    for source, technique, pair, pub, pred in all_effects:
        print(f"| {source} | {technique} | {pair} | {100 * (pub - 1):+.0f} % | {100 * (pred - 1):+.0f} % "
              f"| {100 * (pred - pub):+.0f} |")
    held = [(technique, 100 * abs(pred - pub) <= EFFECT_POINTS)
            for _, technique, pair, pub, pred in all_effects if "(moved" not in pair]
    if held:
        pairs, within = Counter(t for t, _ in held), Counter(t for t, ok in held if ok)
        each = ", ".join(f"{t} {within[t]} of {n}" for t, n in pairs.items())
        print(f"\nHeld-out techniques within {EFFECT_POINTS} points of their published effect: "
              f"{sum(within.values())} of {len(held)} pairs ({each})")


def memory_errors(ok: list[Planned]) -> list[float]:
    """|error| of the memory model on every row that publishes memory (nothing in it is fitted on them)."""
    return [abs(predict_memory(p.job, cuda=True, engine=ENGINES[p.row.source].engine)["total"]
                / float(p.row["memory_gib"]) - 1)
            for p in ok if p.row["memory_gib"]]


def percent(x: float) -> float:
    """`x` as the report prints it, a whole percent, as a fraction."""
    return int(f"{100 * x:.0f}") / 100


def record(scores: Scores, mem_err: list[float]) -> dict:
    """What a spec-sheet plan quotes of this validation (titan_exp.perf.rates.accuracy.published),
    in the report's own rounding."""
    return {"rows": len(scores.held_tps), "median_abs_error": percent(median_abs(scores.held_tps)),
            "pairs_ordered": [sum(k for k, _ in scores.pairs), sum(n for _, n in scores.pairs)],
            "memory": [len(mem_err), percent(median_abs(mem_err)), percent(max(mem_err))],
            "by_device": {name: [n, percent(signed), percent(size)]
                          for name, (n, signed, size) in by_device(scores.listed).items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.published", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", action="store_true", help="print every scored row")
    parser.add_argument("--source", choices=SOURCES, action="append", help="score only these sources (default: all)")
    parser.add_argument("--record", metavar="DATE", help="write the result a spec-sheet plan quotes to "
                        f"{accuracy.RECORDED.name} (titan_exp/perf/rates), dated DATE; with every source only")
    args = parser.parse_args(argv)
    if args.record and args.source:
        parser.error("--record quotes the validation over every source: leave out --source")
    planned = plan_rows(read_rows())
    ok = [p for p in planned if p.job is not None]
    fitting = fitting_set(planned)
    print_header(planned, ok, fitting)
    print()
    print("| held-out source | fitted on (others' fitting rows) | rows | median abs error | worst "
          "| after one scale: median, worst | tables with order kept | pairs on one machine ordered |")
    print("|---|---|---|---|---|---|---|---|")
    sources = [s for s in SOURCES if s in (args.source or SOURCES)]
    fits = {s: fit([p for p in fitting if p.row.source != s]) for s in sources}  # each source's, from the others'
    constants = {s: ", ".join(f"{k} {getattr(eff, k):.3f}" for k in FITTED) for s, eff in fits.items()}
    scores = Scores()
    for source in sources:
        mine = [p for p in ok if p.row.source == source and not moved(p.row)]
        if mine:
            score_source(source, mine, fits[source], constants[source], scores)
    if scores.out_of_order:
        print(f"\nHeld-out tables out of order, by the rows swapped (swapped_pairs; the published faster first): "
              f"{'; '.join(scores.out_of_order)}")
    across = gpu_pairs([(p, pred) for p, pred, _ in scores.listed])
    if across:
        print(f"One configuration on two GPUs in a held-out table (gpu_pairs), the first's tokens/s over the "
              f"second's: {across}")
    if scores.held_moe and scores.held_dense:
        print_moe(scores)
    if scores.listed:
        print_checks(scores, fits)
    print_moved(sources, ok, fits, constants, scores)
    if args.rows:
        print("\n| source, table, row | published | predicted | error |\n|---|---|---|---|")
        for p, pred, e in scores.listed:
            unit, value = published(p.row)
            print(f"| {p.row.key} | {value:,.3g} {unit} | {pred:,.3g} | {100 * e:+.0f} % |")
    print_effects(scores.effects)
    mem_err = memory_errors(ok)
    print()
    mem = (f"memory median |error| {100 * median_abs(mem_err):.0f} %, worst {100 * max(mem_err):.0f} % "
           f"({len(mem_err)} rows of the one source publishing memory, none fitted on)"
           if mem_err else "memory: no rows")
    print(f"Repeats: {repeats([p.row for p in planned])}")
    print(f"held-out: {len(scores.held_tps)} rows from {scores.sources} sources; tokens/s median |error| "
          f"{100 * median_abs(scores.held_tps):.0f} %, worst {100 * max(scores.held_tps):.0f} %; {mem}")
    if args.record:
        recorded = json.loads(accuracy.RECORDED.read_text())
        recorded["published"] = {"date": args.record, "command": "python -m benchmarks.published --record DATE",
                                 **record(scores, mem_err)}
        accuracy.RECORDED.write_text(json.dumps(recorded, indent=1) + "\n")
    return 0
