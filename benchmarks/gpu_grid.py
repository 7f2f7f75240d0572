"""Issue 38 on one GPU: the planner against every single-GPU configuration, and autotune against
the grid, in one command:

    python -m benchmarks.gpu_grid --model llama3_1b [--autotune] [--out DIR]
    python -m benchmarks.gpu_grid --model llama3_8b --layers 8 --global-batch 2   # 8B cut to fit
    python -m benchmarks.gpu_grid --model llama3_1b --budget-minutes 8 --out A   # then, in a second call:
    python -m benchmarks.gpu_grid --model llama3_1b --resume A/gpu_grid.json --autotune --out B
    python -m benchmarks.gpu_grid --smoke --autotune --out DIR   # the same code on CPU, tiny (tests, -m slow)

1. Calibrates the GPU for the model (`python -m titan_exp.perf.calibrate ... --world 1 --compile`),
   unless --no-calibrate (then the profile in TITAN_EXP_CACHE, if any).
2. The grid is autotune's own candidate set for `autotune.search=[activation_checkpoint,compile,
   precision]` at the global batch: AC none / selective / full x compile off / on x bf16, float8
   tensorwise, float8 rowwise on a GPU (titan_exp.perf.autotune.GPU_PRECISIONS), each at every
   split of the global batch into local batch and accumulation. Each member runs `--warmup` +
   `--steps` steps in this process (cluster=debug: no launch per member; the allocator's peak
   is reset between members), beside its predicted step time from the calibrated profile and from
   the GPU's spec sheet, and its predicted memory. Members the model says do not fit run too (an
   out-of-memory member is a row).
3. With --autotune, `python launch.py -m +sweep=autotune` over the same axes and global batch,
   given a quarter of the grid's time as its budget (the target; --autotune-minutes sets another;
   the grids of 2026-11-27 and 2026-11-28 gave it 1.5 minutes, 40 % of the 3B's): its winner as
   the grid measured it against the grid's best, and its whole wall time (its own start and
   planning beyond the budget) against the grid's; its own record (rounds, members, predictions)
   in DIR/autotune.json.

Targets (issue 38): calibrated Spearman >= 0.9 and median |error| <= 10 % on tokens/s; memory
within 10 % of the reserved peak on every member; autotune within 3 % of the grid's best in at
most 25 % of its time. Rows are written as they finish (DIR/gpu_grid.json); --budget-minutes
starts no member after that time (the eager members run first, seconds each, then the compiled
ones), and `--resume DIR/gpu_grid.json` (same model, shape and batch) keeps what an earlier call
measured and runs the rest, then the autotune: one grid over several time-limited calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import REPO, run_job
from benchmarks.gpu_suite import SMOKE_MODEL, calibrate, spec_sheet
from titan_exp.config import compose_job
from titan_exp.perf.autotune import candidates
from titan_exp.perf.calibration.fit import spearman
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.profile import this_machine

SEARCH = "autotune.search=[activation_checkpoint,compile,precision]"
TARGETS = {"spearman": 0.9, "median_error_pct": 10.0, "memory_error_pct": 10.0, "autotune_of_best": 0.97,
           "autotune_time_share": 0.25}


def base_overrides(args: argparse.Namespace) -> list[str]:
    """The job every member shares: model, shape, global batch, one rank."""
    if args.smoke:
        shape = [*SMOKE_MODEL, "training.seq_len=32", "compile.backend=aot_eager"]
    else:
        shape = [f"model={args.model}", f"training.seq_len={args.seq}",
                 *([f"model.n_layers={args.layers}"] if args.layers else [])]
    return [*shape, f"training.global_batch_size={args.global_batch}",
            f"training.local_batch_size={args.global_batch}", "cluster.nproc_per_node=1", SEARCH,
            "metrics.log_freq=1000", "lr_scheduler.warmup_steps=1"]


def free_device(cuda: bool) -> None:
    """Between in-process members: nothing of the last one held, compiled code dropped, the
    allocator's peak reset, so the next member's peak is its own."""
    import torch

    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def predicted(c, cuda: bool) -> dict:
    """A member's predictions: step time from this call's calibrated profile and from the spec
    sheet, and memory (a resumed grid's rows take this call's, so one profile scores them all)."""
    spec = spec_sheet(cuda)
    return {"predicted_step_s": c.predicted_step_s,
            "spec_step_s": predict_step(c.job, spec, cuda=cuda).step_s if spec else None,
            "predicted_memory_gib": c.memory_gib, "predicted_fits": c.fits}


def run_member(c, base: list[str], args: argparse.Namespace, run_dir: Path, cuda: bool) -> dict:
    free_device(cuda)
    start = time.perf_counter()
    code, summary = run_job([*base, *c.overrides, "cluster=debug", f"training.steps={args.warmup + args.steps}",
                             f"metrics.warmup_steps={args.warmup}"], run_dir)
    wall = time.perf_counter() - start
    summary = summary or {"status": "failed", "error": "no summary"}
    tps = summary.get("tokens_per_second_per_device")
    tokens = c.job.training.global_batch_size * c.job.training.seq_len
    return {"name": c.name, "layout": c.layout, "split": c.split, "overrides": c.overrides,
            "status": summary["status"], "reason": (summary.get("error") or "")[:300],
            "tokens_per_second": tps, "step_s": tokens / tps if tps else None,
            "peak_memory_gib": summary.get("peak_memory_gib"),
            "peak_allocated_gib": summary.get("peak_memory_allocated_gib"), **predicted(c, cuda), "wall_s": wall}


def measured_before(path: Path | None, base: list[str]) -> dict[str, dict]:
    """The members an earlier call of this grid measured (--resume: a GPU session's calls are
    limited in time, so one grid may take several), by name; those it skipped run again."""
    if path is None:
        return {}
    earlier = json.loads(path.read_text())
    if earlier["base"] != " ".join(base):
        raise SystemExit(f"--resume {path}: that grid ran {earlier['base']!r}, this one {' '.join(base)!r}; "
                         "resume it with the same --model, --layers, --seq and --global-batch")
    return {r["name"]: r for r in earlier["rows"] if r["status"] != "skipped"}


def scores(rows: list[dict]) -> dict:
    """Spearman and errors of the calibrated and the spec-sheet predictions over the measured members."""
    ok = [r for r in rows if r["status"] == "ok" and r["step_s"]]
    out: dict = {"measured": len(ok), "members": len(rows), "grid_s": sum(r["wall_s"] for r in rows)}
    for key, label in (("predicted_step_s", "calibrated"), ("spec_step_s", "spec")):
        pairs = [(r[key], r["step_s"]) for r in ok if r.get(key)]
        if len(pairs) >= 2:
            errors = [abs(p / m - 1) * 100 for p, m in pairs]
            out[label] = {"spearman": spearman([1 / p for p, _ in pairs], [1 / m for _, m in pairs]),
                          "median_error_pct": statistics.median(errors), "worst_error_pct": max(errors)}
    memory = [abs(r["predicted_memory_gib"] / r["peak_memory_gib"] - 1) * 100 for r in ok if r["peak_memory_gib"]]
    if memory:
        out["memory"] = {"median_error_pct": statistics.median(memory), "worst_error_pct": max(memory)}
    if ok:
        best = max(ok, key=lambda r: r["tokens_per_second"])
        out["best"] = {"name": best["name"], "tokens_per_second": best["tokens_per_second"]}
    return out


def of_grid_best(winner: str | None, grid: list[dict]) -> float | None:
    """The tokens/s the grid measured for autotune's `winner` over the grid's best (None: no winner)."""
    measured = {r["name"]: r["tokens_per_second"] for r in grid if r["status"] == "ok" and r["tokens_per_second"]}
    best = max(measured.values(), default=None)
    return measured.get(winner, 0.0) / best if best and winner else None


def run_autotune(base: list[str], args: argparse.Namespace, sweep: Path, grid: list[dict], grid_s: float) -> dict:
    """The sweep a user runs, over the grid's axes; its winner as the grid measured it."""
    budget = (args.autotune_minutes if args.autotune_minutes is not None
              else TARGETS["autotune_time_share"] * grid_s / 60)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "launch.py", "-m", "+sweep=autotune", *base, f"hydra.sweep.dir={sweep}",
                          f"autotune.budget_minutes={budget:.3f}"], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if out.returncode or not (sweep / "autotune.json").exists():
        return {"status": "failed", "error": (out.stdout + out.stderr)[-2000:], "wall_s": wall}
    record = json.loads((sweep / "autotune.json").read_text())
    (args.out / "autotune.json").write_text(json.dumps(record, indent=1))  # its rounds, kept beside the grid
    winner = record["winner"]["name"] if record.get("winner") else None
    return {"status": "ok", "winner": winner, "winner_of_grid_best": of_grid_best(winner, grid), "wall_s": wall,
            "time_share": wall / grid_s if grid_s else None, "spent_s": record.get("spent_s"), "budget_minutes": budget}


def checks(results: dict) -> list[str]:
    s, lines = results["scores"], []
    if "calibrated" in s:
        c = s["calibrated"]
        lines.append(f"calibrated: Spearman {c['spearman']:.2f} (>= {TARGETS['spearman']}), median |error| "
                     f"{c['median_error_pct']:.0f} % (<= {TARGETS['median_error_pct']:g} %), "
                     f"worst {c['worst_error_pct']:.0f} %")
    if "spec" in s:
        lines.append(f"spec sheet: Spearman {s['spec']['spearman']:.2f}, "
                     f"median |error| {s['spec']['median_error_pct']:.0f} %, "
                     f"worst {s['spec']['worst_error_pct']:.0f} %")
    if "memory" in s:
        lines.append(f"memory: worst |error| {s['memory']['worst_error_pct']:.0f} % "
                     f"(<= {TARGETS['memory_error_pct']:g} %)")
    lines.append(f"grid: {s['measured']} of {s['members']} members measured in {s['grid_s']:.0f} s")
    a = results.get("autotune")
    if a and a["status"] == "ok":
        lines.append(f"autotune: {a['winner']}, {a['winner_of_grid_best'] or 0:.1%} of the grid's best (>= "
                     f"{TARGETS['autotune_of_best']:.0%}) in {a['time_share']:.0%} of its time (<= "
                     f"{TARGETS['autotune_time_share']:.0%})")
    elif a:
        lines.append(f"autotune {a['status']}: {a['error'][-300:]}")
    return lines


def to_markdown(results: dict) -> str:
    def f(x, d=3):
        return "" if x is None else f"{x:.{d}f}"

    lines = [f"Grid on {results['device']}, torch {results['torch']}, {results['date']}: {results['base']}", "",
             "| member | status | tokens/s | step s | calibrated s | spec-sheet s | reserved GiB | allocated GiB "
             "| predicted GiB | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        g = r.get  # a skipped or failed member has no measurement (nor, from an older call, predictions)
        lines.append(f"| {r['name']} | {r['status']} | {f(g('tokens_per_second'), 0)} | {f(g('step_s'))} | "
                     f"{f(g('predicted_step_s'))} | {f(g('spec_step_s'))} | {f(g('peak_memory_gib'), 2)} | "
                     f"{f(g('peak_allocated_gib'), 2)} | {f(g('predicted_memory_gib'), 2)} | {f(g('wall_s'), 0)} |")
    return "\n".join([*lines, "", *(f"- {line}" for line in checks(results)), ""])


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3_1b")
    parser.add_argument("--layers", type=int, default=None, help="model.n_layers: a large model cut to fit one GPU")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--global-batch", type=int, default=2, help="sequences a step; its splits are members")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per member")
    parser.add_argument("--budget-minutes", type=float, default=None, help="start no member after this")
    parser.add_argument("--autotune", action="store_true", help="then autotune over the same axes")
    parser.add_argument("--autotune-minutes", type=float, default=None,
                        help="autotune.budget_minutes (default: a quarter of the grid's time, issue 38's target)")
    parser.add_argument("--resume", type=Path, default=None, metavar="JSON",
                        help="an earlier call's gpu_grid.json: keep the members it measured, run the rest")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the same code on CPU with a tiny model")
    parser.add_argument("--out", type=Path, default=REPO / "gpu_grid")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("no CUDA device here; run with --smoke to exercise the grid on CPU")
    args.out.mkdir(parents=True, exist_ok=True)
    base = base_overrides(args)
    before = measured_before(args.resume, base)
    deadline = time.monotonic() + 60 * args.budget_minutes if args.budget_minutes else float("inf")
    results = {"device": torch.cuda.get_device_name() if cuda else "CPU", "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M"), "base": " ".join(base), "rows": [],
               "calibration": "not calibrated (--no-calibrate)" if args.no_calibrate else
               calibrate([o for o in base if not o.startswith("autotune.")], args.smoke, args.out / "calibrate.log")}
    memory = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 1e9
    grid = candidates(compose_job(base), 1, cuda=cuda, profile=this_machine(1, cuda=cuda), memory_gib=memory)
    # Eager members first (seconds each), then compiled ones (a cold compile each), each group
    # fastest predicted first: a call cut by --budget-minutes measures the most members.
    grid = sorted(grid, key=lambda c: c.job.compile.enable)
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(grid):
            if c.name in before:
                results["rows"].append({**before[c.name], **predicted(c, cuda), "resumed": True})
                continue
            if time.monotonic() > deadline:
                results["rows"].append({"name": c.name, "layout": c.layout, "split": c.split, "overrides": c.overrides,
                                        "status": "skipped", "reason": "over --budget-minutes", **predicted(c, cuda),
                                        "wall_s": 0.0, "step_s": None})
                continue
            results["rows"].append(run_member(c, base, args, Path(tmp) / str(i), cuda))
            results["scores"] = scores(results["rows"])
            (args.out / "gpu_grid.json").write_text(json.dumps(results, indent=1))
        results["scores"] = scores(results["rows"])
        skipped = sum(r["status"] == "skipped" for r in results["rows"])
        if args.autotune and skipped:  # its score needs the whole grid's best and time
            results["autotune"] = {"status": "not run", "wall_s": 0.0,
                                   "error": f"{skipped} members not measured; --resume this grid to finish it"}
        elif args.autotune:
            free_device(cuda)
            results["autotune"] = run_autotune(base, args, Path(tmp) / "autotune", results["rows"],
                                               results["scores"]["grid_s"])
    (args.out / "gpu_grid.json").write_text(json.dumps(results, indent=1))
    (args.out / "gpu_grid.md").write_text(to_markdown(results))
    print(to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
