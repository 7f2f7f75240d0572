"""Autotune: predict every candidate, measure those that may be the fastest, report the fastest.

    python launch.py -m +sweep=autotune cluster.nproc_per_node=4 [model=...] \
        [autotune.search=[layout,activation_checkpoint]]

0. Calibration: what the machine profile lacks for these candidates (the model's block at every
   TP degree, compile when searched, the collectives at the world size) is measured first,
   through the job's executor (titan_exp.perf.calibration.run.cover); its time counts in the machine
   time the record reports. With autotune.calibrate=false those parts are FLOPs estimates, and
   the record's first line says so and how far off such estimates were when last checked.
1. Candidates: every valid layout of the world size (titan_exp.perf.search.planner), times the values of
   each other axis in `autotune.search` (AC mode, compile, precision; float8_filter: each float8
   tensorwise or rowwise candidate also with torchao's shape filter), at the job's global batch,
   each checked by the validator the launcher runs (titan_exp.perf.search.axes: the same candidates
   `python -m titan_exp.perf.plan` ranks), at every split of the global batch that validates
   (local batch and accumulation, PP microbatch): a layout is never dropped for want of a split.
   A pipeline's stages are balanced, unless the job sets their split (titan_exp.perf.search.stages).
2. Pruning: the memory model drops what would not fit. Each prediction gets an interval as wide
   as the predictions' error when last checked (perf.rates.accuracy.last_check); every candidate whose
   interval reaches the best one's is measured (at most `autotune.top_k`, and as many as
   `autotune.budget_minutes` allows).
3. Rounds: each runs the survivors for `warmup_steps` + `steps` x 2^round steps as ordinary sweep
   members (their own run dirs), pools each candidate's timed steps over its rounds, drops members
   that failed or ran out of memory, those slower than `drop_slower_than` x the round's fastest
   and those whose measured 95 % interval does not reach `tolerance` above the fastest's rate
   (closer than that, candidates are as good as tied); until one is left, or the next round would
   overrun the budget.
4. The record: `<sweep dir>/autotune.json` and `autotune.md` (the winner with its tokens/s and a
   95 % interval, prediction vs measurement per member with its batch split, what was pruned and
   why, machine time spent, calibration included, vs the whole grid's); report.md includes it.
   The measured members refit the profile.

With cluster.hardware=FILE (titan_exp.perf.rates.hardware) the candidates are predicted for the GPUs the
file describes, nothing is calibrated, the memory limit is the file's GPU's (unless
autotune.device_memory_gib is set), the profile is not refit (it is the file's, not a measured
one), and the record's first line says which values came from the file.

The search is Hydra-free (`Autotune(..., launch=...)`); hydra_plugins/titan_exp_autotune wraps it
as a Hydra sweeper, which keeps Hydra's multirun layout and callbacks (the report).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from titan_exp.config import AutotuneAxis, Executor, JobConfig, layout_label
from titan_exp.files import atomic_write
from titan_exp.perf.calibration.fit import BAND, predicted_interval, refit, throughput_interval
from titan_exp.perf.calibration.run import Coverage, cover
from titan_exp.perf.model.memory import predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates import hardware as hw
from titan_exp.perf.rates.accuracy import ESTIMATES, Check, accuracy_kind, estimates_line, last_check, record_accuracy
from titan_exp.perf.rates.profile import this_machine
from titan_exp.perf.search.axes import labels, override_key, variants
from titan_exp.perf.search.layouts import (
    batch_line,
    batch_splits,
    factorizations,
    global_batch_of,
    layout_overrides,
    split_label,
)
from titan_exp.perf.search.planner import device_memory_gib
from titan_exp.perf.search.stages import balanced_all
from titan_exp.record import RunDir, Status
from titan_exp.validation import resolved

logger = logging.getLogger("titan_exp.autotune")


# -- candidates ------------------------------------------------------------------------------
@dataclass
class Member:
    round: int
    run_dir: str
    status: str
    step_times_s: list[float] = field(default_factory=list)  # timed (after warm-up)
    wall_s: float = 0.0
    error: str = ""


@dataclass(eq=False)  # compared by identity
class Candidate:
    name: str
    overrides: list[str]
    job: JobConfig
    predicted_step_s: float
    predicted_tps: float
    breakdown: dict[str, float]
    memory_gib: float
    fits: bool
    layout: str = ""  # the layout and the other axes' values, without the split
    split: str = ""  # layouts.split_label: the batch split it runs with
    pruned: str = ""  # why it was not measured further; empty for the winner
    members: list[Member] = field(default_factory=list)

    @property
    def times(self) -> list[float]:
        return [t for m in self.members if m.status == Status.ok for t in m.step_times_s]

    def measured(self, tokens_per_step: int, world: int) -> Optional[tuple[float, float, float]]:
        """(tokens/s per device, low, high of its 95 % interval) over every timed step."""
        return throughput_interval(self.times, tokens_per_step, world) if self.times else None


def candidates(job: JobConfig, world: int, *, cuda: bool, profile, memory_gib: float) -> list[Candidate]:
    """Every valid candidate, predicted; those that fit first, fastest first. A candidate is a
    layout (with a value of each other axis searched) at one split of the global batch: every
    split that validates is one (layouts.batch_splits), so no layout is lost for want of a split,
    and the split a layout runs best with is a prediction like the rest, measured when it is close."""
    axes = job.autotune.search
    job = resolved(job)
    global_batch = global_batch_of(job, world)
    searched = AutotuneAxis.layout in axes
    degree_sets = factorizations(world, job.model.n_experts) if searched else [job.parallelism.layout]
    out, seen = [], set()
    for variant, extra in variants(job, axes, cuda=cuda):  # once: a layout changes none of their fields
        for degrees in degree_sets:
            splits = balanced_all(batch_splits(variant, degrees, global_batch, cuda=cuda), profile, cuda=cuda,
                                  memory_gib=memory_gib)  # a pipeline's stages balanced (perf.search.stages)
            for split in splits:
                overrides = [*layout_overrides(split), f"training.global_batch_size={global_batch}",
                             f"cluster.nproc_per_node={split.cluster.nproc_per_node}", *extra]  # per node
                if tuple(overrides) in seen:
                    continue
                seen.add(tuple(overrides))
                step = predict_step(split, profile, cuda=cuda)
                memory = predict_memory(split, cuda=cuda)["total"]
                layout = ", ".join([layout_label(split.parallelism.layout), *labels(extra)])
                out.append(Candidate(f"{layout} [{split_label(split)}]", overrides, split, step.step_s,
                                     step.tokens_per_s_per_device, step.breakdown(), memory, memory <= memory_gib,
                                     layout=layout, split=split_label(split)))
    return sorted(out, key=lambda c: (not c.fits, -c.predicted_tps))


def startup_estimate_s(job: JobConfig, cuda: bool) -> float:
    """Seconds a member takes beyond its steps before any was measured: process start and imports
    (about 5 s for 2 ranks to 20 s for 8 on a 2-core CPU, benchmarks/data/startup_cpu.csv), and a cold compile."""
    base = 20.0 if cuda else 4.0 + 2.0 * job.world_size
    return base + (15.0 if job.compile.enable else 0.0)


# -- the search -------------------------------------------------------------------------------
LaunchBatch = Callable[[list[list[str]]], list[Path]]


class Autotune:
    def __init__(self, job: JobConfig, arguments: list[str], launch: LaunchBatch, sweep_dir: Path, *,
                 cuda: bool | None = None, profile=None):
        import torch

        self.hardware, problems = hw.checked(job)  # before anything is calibrated or measured
        if problems:
            raise ValueError("autotune: " + "; ".join(problems))
        self.job, self.sweep_dir, self.launch = job, Path(sweep_dir), launch
        self.cuda = (self.hardware is not None or torch.cuda.is_available()) if cuda is None else cuda
        self.world = job.world_size
        self.arguments = list(arguments)
        if self.hardware:  # the GPUs the file describes, not this machine
            self.profile = profile or hw.profile(job, self.hardware)
            self.memory_gib = hw.memory_gib(job, self.hardware)
        else:
            self.profile = profile or this_machine(self.world, cuda=self.cuda, nodes=job.cluster.nnodes)
            self.memory_gib = job.autotune.device_memory_gib or device_memory_gib(self.world, self.cuda)
        self.tokens_per_step = 0
        self.rounds: list[dict[str, Any]] = []
        self.spent_s = 0.0
        self.coverage = Coverage(self.profile, [], [], 0.0)

    def run(self) -> dict[str, Any]:
        a = self.job.autotune
        budget_s = a.budget_minutes * 60
        compile = AutotuneAxis.compile in a.search or self.job.compile.enable
        self.coverage = cover(self.job, self.world, self.profile, compile=compile, folder=None,
                              run_dir=self.sweep_dir / "calibration")
        self.profile, self.spent_s = self.coverage.profile, self.coverage.seconds
        check = last_check(self.profile, estimated=bool(self.coverage.lacks))
        grid = candidates(self.job, self.world, cuda=self.cuda, profile=self.profile, memory_gib=self.memory_gib)
        if not grid:
            raise ValueError(f"autotune: no valid candidate on {self.world} ranks for autotune.search="
                             f"{[s.value for s in a.search]}")
        self.tokens_per_step = grid[0].job.training.global_batch_size * grid[0].job.training.seq_len
        for c in grid:
            if not c.fits:
                c.pruned = f"memory model: {c.memory_gib:.2f} GiB > {self.memory_gib:.2f} GiB per device"
        chosen = self._contenders([c for c in grid if c.fits], check, budget_s)
        survivors, round_no = chosen, 0
        stop_reason = "one candidate measured"
        while survivors:
            steps = a.steps * 2**round_no
            self._measure(survivors, round_no, steps)
            survivors = self._select(survivors, round_no)
            if len(survivors) <= 1:
                stop_reason = (f"no other candidate may be more than {a.tolerance:.0%} faster than the fastest"
                               if len(chosen) > 1 and survivors
                               else stop_reason if survivors else "no member finished")
                break
            round_no += 1
            estimate = sum(self._cost_estimate(c, a.steps * 2**round_no) for c in survivors)
            if self.spent_s + estimate > budget_s:
                stop_reason = (f"budget: round {round_no} would take about {estimate:.0f} s, "
                               f"{max(0.0, budget_s - self.spent_s):.0f} s of {budget_s:.0f} s left")
                break
        ranked = sorted((c for c in grid if c.measured(self.tokens_per_step, self.world)),
                        key=lambda c: -c.measured(self.tokens_per_step, self.world)[0])
        winner = next((c for c in ranked if c in survivors), ranked[0] if ranked else None)
        for c in survivors:
            if c is not winner and not c.pruned:
                c.pruned = f"measured slower than the winner when the search stopped ({stop_reason})"
        record = self._record(grid, winner, stop_reason, budget_s, check)
        if a.refit and self.hardware is None:
            record["refit"] = self._refit(grid)
        self._write(record)
        return record

    def _contenders(self, fitting: list[Candidate], check: Check, budget_s: float) -> list[Candidate]:
        """The candidates measured first: every one whose predicted interval reaches the best
        one's (at most top_k), fewer if their first round's estimate would overrun the budget."""
        a = self.job.autotune
        if not fitting:
            return []
        floor = predicted_interval(fitting[0].predicted_tps, check)[0]
        chosen = [c for c in fitting if predicted_interval(c.predicted_tps, check)[1] >= floor][: a.top_k]

        def first_round_s(cs):
            return sum(startup_estimate_s(c.job, self.cuda) + (a.warmup_steps + a.steps) * c.predicted_step_s
                       for c in cs)

        while len(chosen) > 1 and self.spent_s + first_round_s(chosen) > budget_s:
            chosen.pop()
        band = f"±{predicted_interval(1.0, check)[1] - 1:.0%}"
        for i, c in enumerate(fitting):
            if c in chosen:
                continue
            reaches = predicted_interval(c.predicted_tps, check)[1] >= floor
            c.pruned = (f"predicted {c.predicted_tps:,.0f} tokens/s/device, ranked {i + 1} of {len(fitting)} that fit: "
                        + (f"outside the {len(chosen)} measured ({'top_k' if a.top_k and i >= a.top_k else 'budget'})"
                           if reaches else f"its interval ({band}) does not reach the best one's"))
        return chosen

    def _member_overrides(self, c: Candidate, steps: int) -> list[str]:
        """The command line's overrides, but for the keys the candidate sets, then the candidate's."""
        a = self.job.autotune
        own = [*c.overrides, f"training.steps={a.warmup_steps + steps}", f"metrics.warmup_steps={a.warmup_steps}"]
        keys = {override_key(o) for o in own}
        return [*(o for o in self.arguments if override_key(o) not in keys), *own]

    def _measure(self, cs: list[Candidate], round_no: int, steps: int) -> None:
        logger.info("autotune round %d: %d member(s), %d timed steps each: %s", round_no, len(cs), steps,
                    ", ".join(c.name for c in cs))
        start = time.perf_counter()
        run_dirs = self.launch([self._member_overrides(c, steps) for c in cs])
        wall = time.perf_counter() - start
        self.spent_s += wall
        if self.job.cluster.executor == Executor.slurm:  # members it left queued: submit them, wait
            from titan_exp.cluster.slurm import submit_pending

            submit_pending(self.sweep_dir, wait=True)
        warm = self.job.autotune.warmup_steps
        members = []
        for c, path in zip(cs, run_dirs):
            s = RunDir(path).read_summary()
            times = (s.step_times_s or [])[warm:] if s else []
            m = Member(round_no, str(Path(path).name), s.status.value if s else "no summary", times,
                       wall_s=(s.wall_time_s or 0.0) if s else 0.0,
                       error=((s.error or "").splitlines() or [""])[0][:200] if s else "")
            c.members.append(m)
            members.append(m)
        # Machine time not inside any rank (process start, imports, the launcher) shared evenly.
        inside = sum(m.wall_s for m in members)
        for m in members:
            m.wall_s += max(0.0, wall - inside) / len(members)
        self.rounds.append({"round": round_no, "timed_steps": steps, "wall_s": wall,
                            "members": [dataclasses.asdict(m) for m in members]})

    def _select(self, cs: list[Candidate], round_no: int) -> list[Candidate]:
        """The candidates that may still be the fastest: those that finished, reach drop_slower_than
        of the fastest, and whose measured interval reaches more than `tolerance` above the
        fastest's rate (closer than that they are as good as tied, and a round would not tell)."""
        a = self.job.autotune
        alive = []
        for c in cs:
            last = c.members[-1]
            if last.status != Status.ok:
                c.pruned = f"round {round_no}: {last.status}" + (f" ({last.error})" if last.error else "")
            else:
                alive.append(c)
        if not alive:
            return []
        measured = {id(c): c.measured(self.tokens_per_step, self.world) for c in alive}
        alive.sort(key=lambda c: -measured[id(c)][0])
        best = measured[id(alive[0])][0]
        bar = best * (1 + a.tolerance)
        keep = [alive[0]]
        for c in alive[1:]:
            rate, _, high = measured[id(c)]
            if rate < a.drop_slower_than * best:
                c.pruned = (f"round {round_no}: {rate:,.0f} tokens/s/device, below {a.drop_slower_than:.0%} "
                            f"of the fastest ({best:,.0f})")
            elif high <= bar:  # NaN (one timed step) compares False: it stays
                c.pruned = (f"round {round_no}: {rate:,.0f} tokens/s/device, its 95 % interval (up to {high:,.0f}) "
                            f"not above the fastest's {best:,.0f} + {a.tolerance:.0%}")
            else:
                keep.append(c)
        return keep

    def _cost_estimate(self, c: Candidate, steps: int) -> float:
        last = c.members[-1]
        mean = statistics.fmean(c.times) if c.times else c.predicted_step_s
        return last.wall_s + (steps - len(last.step_times_s)) * mean

    def _record(self, grid: list[Candidate], winner: Candidate | None, stop_reason: str, budget_s: float,
                check: Check) -> dict:
        a = self.job.autotune
        # The whole grid, each candidate once with the first round's steps: the measured
        # per-member overhead (start-up, and a compiled member's compile: the mean of the measured
        # members compiled alike, else of all) plus its predicted steps, scaled by how the
        # predictions did.
        first = [c for c in grid if c.members and c.members[0].status == Status.ok]
        overheads = [(c.job.compile.enable, c.members[0].wall_s - sum(c.members[0].step_times_s)) for c in first]

        def overhead(c: Candidate) -> float:
            alike = [o for compiled, o in overheads if compiled == c.job.compile.enable]
            return statistics.fmean(alike or [o for _, o in overheads]) if overheads else 0.0

        ratio = (statistics.median(statistics.fmean(c.members[0].step_times_s) / c.predicted_step_s for c in first)
                 if first else 1.0)
        grid_s = sum(overhead(c) + (a.warmup_steps + a.steps) * c.predicted_step_s * ratio for c in grid)

        def entry(c: Candidate) -> dict:
            m = c.measured(self.tokens_per_step, self.world)
            return {"name": c.name, "overrides": c.overrides, "predicted_tokens_per_s": c.predicted_tps,
                    "predicted_step_s": c.predicted_step_s, "predicted_breakdown_s": c.breakdown,
                    "predicted_memory_gib": c.memory_gib, "fits": c.fits, "layout": c.layout, "split": c.split,
                    "pruned": c.pruned,
                    "measured_tokens_per_s": m[0] if m else None, "interval": list(m[1:]) if m else None,
                    "prediction_error": c.predicted_tps / m[0] - 1 if m else None,
                    "members": [m.run_dir for m in c.members]}

        cov = self.coverage
        return {
            "world": self.world, "profile": self.profile.name if self.profile.source != "defaults" else "defaults",
            "hardware": self.hardware.line() if self.hardware else None,
            "calibration": {"measured": cov.lacked if cov.seconds else [], "seconds": cov.seconds,
                            "estimated": cov.lacks,
                            "estimates_line": estimates_line(cov.lacks, self.profile, None) if cov.lacks else ""},
            "prediction_check": dataclasses.asdict(check) | {"band": BAND},
            "search": [s.value for s in a.search], "top_k": a.top_k, "budget_s": budget_s,
            "spent_s": self.spent_s, "spent_device_s": self.spent_s * self.world,
            "grid": {"candidates": len(grid), "fit": sum(c.fits for c in grid), "estimated_s": grid_s,
                     "batch": batch_line(self.job, self.world)},
            "stopped": stop_reason, "rounds": self.rounds,
            "winner": entry(winner) if winner else None,
            "candidates": [entry(c) for c in grid],
        }

    def _refit(self, grid: list[Candidate]) -> dict:
        # The median timed step, as summary.json's tokens/s: a prediction is of a steady step, which
        # one stalled step would move the mean away from.
        runs = [(predict_step(c.job, self.profile, cuda=self.cuda), statistics.median(c.times))
                for c in grid if c.times]
        if not runs:
            return {}
        fitted = refit(self.profile, runs)
        # How these predictions did, for the next plan to say: FLOPs estimates where the profile
        # lacked the model's block, else this profile's.
        kind = ESTIMATES if self.coverage.lacks else accuracy_kind(self.profile)
        record_accuracy(kind, fitted.corrections.median_error_before, len(runs))
        path = fitted.save()
        c = fitted.corrections
        logger.info("refit %s to %d measured runs: median step-time error %.0f%% -> %.0f%%", path, len(runs),
                    100 * c.median_error_before, 100 * c.median_error_after)
        return {"profile": str(path), **dataclasses.asdict(c)}

    def _write(self, record: dict) -> None:
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.sweep_dir / "autotune.json", json.dumps(record, indent=1, default=str))
        atomic_write(self.sweep_dir / "autotune.md", markdown(record))


def _rate(x: float) -> str:
    return "∞" if x == float("inf") else "?" if x != x else f"{x:,.0f}"


def markdown(record: dict) -> str:
    w = record["winner"]
    lines = ["## Autotune", ""]
    if record.get("hardware"):
        lines += [f"Predicted for the GPUs of cluster.hardware ({record['hardware']}); the profile is not refit "
                  "to the measured members.", ""]
    cal = record.get("calibration") or {}
    if cal.get("estimates_line"):
        lines += [f"**{cal['estimates_line']}.**", ""]
    if w:
        lo, hi = w["interval"]
        lines.append(f"**Winner: {w['name']}** — {w['measured_tokens_per_s']:,.0f} tokens/s/device "
                     f"(95 % interval {_rate(lo)}–{_rate(hi)}); predicted {w['predicted_tokens_per_s']:,.0f} "
                     f"({w['prediction_error']:+.0%}).")
    else:
        lines.append("**No winner**: no measured member finished.")
    g = record["grid"]
    calibrated = (f" Calibrated first ({'; '.join(cal['measured'])}): {cal['seconds']:.0f} s, counted in the "
                  "machine time." if cal.get("measured") else "")
    check = record.get("prediction_check")
    band = (f" Each prediction was given ±{check['band'] * check['median_abs_error']:.0%}: {check['band']:g} x the "
            f"predictions' median error when last checked ({check['when']}, {check['where']})." if check else "")
    batch = f" {g['batch'][0].upper()}{g['batch'][1:]}." if g.get("batch") else ""
    lines += ["", f"{g['candidates']} candidates (each layout at each split of the global batch) on "
                  f"{record['world']} ranks (search: {', '.join(record['search'])}).{batch} "
                  f"{g['fit']} fit in memory; times from {record['profile']}.{calibrated}{band} Machine time: "
                  f"{record['spent_s']:.0f} s ({record['spent_device_s']:.0f} device-s) vs about "
                  f"{g['estimated_s']:.0f} s for the whole grid ({record['spent_s'] / g['estimated_s']:.0%}). "
                  f"Stopped: {record['stopped']}.", "",
              "| layout | batch split | predicted tok/s/dev | measured tok/s/dev (95 %) | error | predicted GiB "
              "| model: compute / comm / bubble / recompute s | rounds | outcome |",
              "|---|---|---|---|---|---|---|---|---|"]
    measured = [c for c in record["candidates"] if c["measured_tokens_per_s"]]
    # Unmeasured: each layout's fastest predicted split; the other splits are in autotune.json.
    shown = {c["layout"] for c in measured}
    rest = []
    for c in record["candidates"]:
        if not c["measured_tokens_per_s"] and c["layout"] not in shown:
            shown.add(c["layout"])
            rest.append(c)
    hidden = len(record["candidates"]) - len(measured) - len(rest)
    for c in sorted(measured, key=lambda c: -c["measured_tokens_per_s"]) + rest:
        b = c["predicted_breakdown_s"]
        m = (f"{c['measured_tokens_per_s']:,.0f} ({_rate(c['interval'][0])}–{_rate(c['interval'][1])})"
             if c["measured_tokens_per_s"] else "")
        err = f"{c['prediction_error']:+.0%}" if c["prediction_error"] is not None else ""
        outcome = "winner" if w and c["name"] == w["name"] else c["pruned"]
        lines.append(f"| {c['layout']} | {c['split']} | {c['predicted_tokens_per_s']:,.0f} | {m} | {err} "
                     f"| {c['predicted_memory_gib']:.2f} "
                     f"| {b['compute']:.3f} / {b['exposed_comm']:.3f} / {b['bubble']:.3f} / {b['recompute']:.3f} "
                     f"| {len(c['members'])} | {outcome} |")
    if hidden:
        lines += ["", f"Not shown: {hidden} other splits of these layouts, none measured (autotune.json lists them)."]
    r = record.get("refit")
    if r:
        lines += ["", f"Profile refit to this sweep's measured members: median step-time error "
                      f"{r['median_error_before']:.0%} -> {r['median_error_after']:.0%} ({r['profile']})."]
    return "\n".join(lines) + "\n"
