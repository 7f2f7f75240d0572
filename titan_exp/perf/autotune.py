"""Autotune: predict every candidate, measure the best few, report the fastest.

    python launch.py -m +sweep=autotune cluster.nproc_per_node=4 [model=...] [autotune.search=[layout,activation_checkpoint]]

1. Candidates: every valid layout of the world size (titan_exp.perf.plan), times the values of each
   other axis in `autotune.search` (AC mode, compile, precision, local batch, PP microbatch), at
   the job's global batch, each checked by the validator the launcher runs.
2. Pruning: the memory model drops what would not fit; the performance model (with this
   machine's profile, `python -m titan_exp.perf.calibrate`) ranks the rest by tokens/s per device, and
   the first `autotune.top_k` are measured; as many as `autotune.budget_minutes` allows.
3. Successive halving: each round runs the survivors for `warmup_steps` + `steps` x 2^round
   steps as ordinary sweep members (their own run dirs), pools each candidate's timed steps over
   its rounds, drops members that failed or ran out of memory and those slower than
   `drop_slower_than` x the round's fastest, then keeps the faster half; until one is left or the
   next round would overrun the budget.
4. The record: `<sweep dir>/autotune.json` and `autotune.md` (the winner with its tokens/s and a
   95 % interval, prediction vs measurement per member, what was pruned and why, machine time
   spent vs the whole grid's); report.md includes it. The measured members refit the profile.

The search is Hydra-free (`Autotune(..., launch=...)`); hydra_plugins/titan_exp_autotune wraps it
as a Hydra sweeper, which keeps Hydra's multirun layout and callbacks (the report).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from titan_exp.config import CONF, ACMode, AutotuneAxis, Executor, JobConfig
from titan_exp.files import atomic_write
from titan_exp.record import RunDir, Status

logger = logging.getLogger("titan_exp.autotune")


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


# How a candidate's overrides read in its name.
LABELS = {"activation_checkpoint.mode": "AC {}", "compile.enable": "compile={}", "precision": "{}",
          "training.local_batch_size": "local batch {}", "parallelism.pipeline_parallel_microbatch_size": "microbatch {}"}


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
    pruned: str = ""  # why it was not measured further; empty for the winner
    members: list[Member] = field(default_factory=list)

    @property
    def times(self) -> list[float]:
        return [t for m in self.members if m.status == Status.ok for t in m.step_times_s]

    def measured(self, tokens_per_step: int, world: int) -> Optional[tuple[float, float, float]]:
        """(tokens/s per device, low, high of its 95 % interval) over every timed step."""
        from titan_exp.perf.fit import throughput_interval

        return throughput_interval(self.times, tokens_per_step, world) if self.times else None


def _variant(job: JobConfig, overrides: list[str], axis: AutotuneAxis, cuda: bool) -> list[tuple[JobConfig, list[str]]]:
    """The variants of one candidate along one axis."""
    from omegaconf import OmegaConf

    r = dataclasses.replace
    if axis == AutotuneAxis.activation_checkpoint:
        return [(r(job, activation_checkpoint=r(job.activation_checkpoint, mode=mode)),
                 [*overrides, f"activation_checkpoint.mode={mode.value}"]) for mode in ACMode]
    if axis == AutotuneAxis.compile:
        return [(r(job, compile=r(job.compile, enable=on)), [*overrides, f"compile.enable={str(on).lower()}"])
                for on in (False, True)]
    if axis == AutotuneAxis.precision:
        out = []
        for name in ("fp32", "bf16", *(("float8",) if cuda else ())):
            preset = OmegaConf.merge(OmegaConf.structured(job.precision), OmegaConf.load(CONF / "precision" / f"{name}.yaml"))
            out.append((r(job, precision=OmegaConf.to_object(preset)), [*overrides, f"precision={name}"]))
        return out
    p, t = job.parallelism, job.training
    dp = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
    if axis == AutotuneAxis.local_batch_size:
        per_rank = t.global_batch_size // dp
        return [(r(job, training=r(t, local_batch_size=b)), [*overrides, f"training.local_batch_size={b}"])
                for b in range(1, per_rank + 1) if per_rank % b == 0]
    if axis == AutotuneAxis.microbatch_size and p.pipeline_parallel_degree > 1:
        return [(r(job, parallelism=r(p, pipeline_parallel_microbatch_size=m)),
                 [*overrides, f"parallelism.pipeline_parallel_microbatch_size={m}"])
                for m in range(1, t.local_batch_size + 1) if t.local_batch_size % m == 0]
    return [(job, overrides)]


def candidates(job: JobConfig, world: int, *, cuda: bool, profile, memory_gib: float) -> list[Candidate]:
    """Every valid candidate, predicted; those that fit first, fastest first."""
    from titan_exp.config import layout_label
    from titan_exp.perf.memory import predict_memory
    from titan_exp.perf.step import predict_step
    from titan_exp.perf.plan import layout_overrides, valid_layouts, with_layout
    from titan_exp.validation import resolve, validate

    axes = job.autotune.search
    job = resolve(job) if job.parallelism.data_parallel_shard_degree == -1 else job
    global_batch = job.training.global_batch_size
    if AutotuneAxis.layout in axes:
        layouts = valid_layouts(job, world, cuda=cuda)
    else:
        layouts = [with_layout(job, job.parallelism.layout, global_batch)]
    out, seen = [], set()
    for base in layouts:
        variants = [(base, [*layout_overrides(base), f"training.global_batch_size={base.training.global_batch_size}",
                            f"cluster.nproc_per_node={world}"])]
        for axis in axes:
            if axis != AutotuneAxis.layout:
                variants = [v for j, o in variants for v in _variant(j, o, axis, cuda)]
        for variant, overrides in variants:
            if validate(variant, cuda=cuda) or tuple(overrides) in seen:
                continue
            seen.add(tuple(overrides))
            variant = resolve(variant)
            step = predict_step(variant, profile, cuda=cuda)
            memory = predict_memory(variant, cuda=cuda)["total"]
            extras = [LABELS[_key(o)].format(o.split("=", 1)[1]) for o in overrides[len(layout_overrides(base)) + 2:]]
            name = ", ".join([layout_label(variant.parallelism.layout), *extras])
            out.append(Candidate(name, overrides, variant, step.step_s, step.tokens_per_s_per_device,
                                 step.breakdown(), memory, memory <= memory_gib))
    return sorted(out, key=lambda c: (not c.fits, -c.predicted_tps))


def startup_estimate_s(job: JobConfig, cuda: bool) -> float:
    """Seconds a member takes beyond its steps before any was measured: process start and imports
    (about 5 s for 2 ranks to 20 s for 8 on a 2-core CPU, FACTS.md), and a cold compile."""
    base = 20.0 if cuda else 4.0 + 2.0 * job.world_size
    return base + (15.0 if job.compile.enable else 0.0)


# -- the search -------------------------------------------------------------------------------
LaunchBatch = Callable[[list[list[str]]], list[Path]]


class Autotune:
    def __init__(self, job: JobConfig, arguments: list[str], launch: LaunchBatch, sweep_dir: Path, *,
                 cuda: bool | None = None, profile=None):
        import torch

        from titan_exp.perf.profile import this_machine
        from titan_exp.perf.plan import device_memory_gib

        self.job, self.sweep_dir, self.launch = job, Path(sweep_dir), launch
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.world = job.world_size
        self.arguments = list(arguments)
        self.profile = profile or this_machine(self.world, cuda=self.cuda, nodes=job.cluster.nnodes)
        self.memory_gib = job.autotune.device_memory_gib or device_memory_gib(self.world, self.cuda)
        self.tokens_per_step = 0
        self.rounds: list[dict[str, Any]] = []
        self.spent_s = 0.0

    def run(self) -> dict[str, Any]:
        a = self.job.autotune
        budget_s = a.budget_minutes * 60
        grid = candidates(self.job, self.world, cuda=self.cuda, profile=self.profile, memory_gib=self.memory_gib)
        if not grid:
            raise ValueError(f"autotune: no valid candidate on {self.world} ranks for autotune.search="
                             f"{[s.value for s in a.search]}")
        self.tokens_per_step = grid[0].job.training.global_batch_size * grid[0].job.training.seq_len
        for c in grid:
            if not c.fits:
                c.pruned = f"memory model: {c.memory_gib:.2f} GiB > {self.memory_gib:.2f} GiB per device"
        fitting = [c for c in grid if c.fits]
        chosen = fitting[: a.top_k]
        # The first round within the budget: drop the lowest-ranked until its estimate fits.
        def first_round_s(cs):
            return sum(startup_estimate_s(c.job, self.cuda) + (a.warmup_steps + a.steps) * c.predicted_step_s for c in cs)
        while len(chosen) > 1 and first_round_s(chosen) > budget_s:
            chosen.pop()
        for i, c in enumerate(fitting):
            if c not in chosen:
                c.pruned = (f"predicted {c.predicted_tps:,.0f} tokens/s/device, ranked {i + 1} of {len(fitting)} that fit: "
                            f"outside the {len(chosen)} measured" + (" (budget)" if i < a.top_k else f" (top_k={a.top_k})"))
        survivors, round_no = chosen, 0
        stop_reason = "one candidate left"
        while survivors:
            steps = a.steps * 2**round_no
            self._measure(survivors, round_no, steps)
            survivors = self._select(survivors, round_no)
            if len(survivors) <= 1:
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
        record = self._record(grid, winner, stop_reason, budget_s)
        if a.refit:
            record["refit"] = self._refit(grid)
        self._write(record)
        return record

    def _member_overrides(self, c: Candidate, steps: int) -> list[str]:
        """The command line's overrides, but for the keys the candidate sets, then the candidate's."""
        a = self.job.autotune
        own = [*c.overrides, f"training.steps={a.warmup_steps + steps}", f"metrics.warmup_steps={a.warmup_steps}"]
        keys = {_key(o) for o in own}
        return [*(o for o in self.arguments if _key(o) not in keys), *own]

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
        rate = {id(c): c.measured(self.tokens_per_step, self.world)[0] for c in alive}
        best = max(rate.values())
        alive.sort(key=lambda c: -rate[id(c)])
        keep = []
        for i, c in enumerate(alive):
            if rate[id(c)] < a.drop_slower_than * best:
                c.pruned = (f"round {round_no}: {rate[id(c)]:,.0f} tokens/s/device, below {a.drop_slower_than:.0%} "
                            f"of the fastest ({best:,.0f})")
            elif i >= math.ceil(len(alive) / 2) and len(alive) > 1:
                c.pruned = f"round {round_no}: ranked {i + 1} of {len(alive)} measured; the faster half goes on"
            else:
                keep.append(c)
        return keep

    def _cost_estimate(self, c: Candidate, steps: int) -> float:
        last = c.members[-1]
        mean = statistics.fmean(c.times) if c.times else c.predicted_step_s
        return last.wall_s + (steps - len(last.step_times_s)) * mean

    def _record(self, grid: list[Candidate], winner: Candidate | None, stop_reason: str, budget_s: float) -> dict:
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

        ratio = statistics.median(statistics.fmean(c.members[0].step_times_s) / c.predicted_step_s for c in first) if first else 1.0
        grid_s = sum(overhead(c) + (a.warmup_steps + a.steps) * c.predicted_step_s * ratio for c in grid)

        def entry(c: Candidate) -> dict:
            m = c.measured(self.tokens_per_step, self.world)
            return {"name": c.name, "overrides": c.overrides, "predicted_tokens_per_s": c.predicted_tps,
                    "predicted_step_s": c.predicted_step_s, "predicted_breakdown_s": c.breakdown,
                    "predicted_memory_gib": c.memory_gib, "fits": c.fits, "pruned": c.pruned,
                    "measured_tokens_per_s": m[0] if m else None, "interval": list(m[1:]) if m else None,
                    "prediction_error": c.predicted_tps / m[0] - 1 if m else None,
                    "members": [m.run_dir for m in c.members]}

        return {
            "world": self.world, "profile": self.profile.name if self.profile.source != "defaults" else "defaults",
            "search": [s.value for s in a.search], "top_k": a.top_k, "budget_s": budget_s,
            "spent_s": self.spent_s, "spent_device_s": self.spent_s * self.world,
            "grid": {"candidates": len(grid), "fit": sum(c.fits for c in grid), "estimated_s": grid_s},
            "stopped": stop_reason, "rounds": self.rounds,
            "winner": entry(winner) if winner else None,
            "candidates": [entry(c) for c in grid],
        }

    def _refit(self, grid: list[Candidate]) -> dict:
        from titan_exp.perf.fit import refit
        from titan_exp.perf.profile import record_accuracy
        from titan_exp.perf.step import predict_step

        runs = [(predict_step(c.job, self.profile, cuda=self.cuda), statistics.fmean(c.times)) for c in grid if c.times]
        if not runs:
            return {}
        fitted = refit(self.profile, runs)
        record_accuracy(self.profile, fitted.corrections.median_error_before, len(runs))
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
    if w:
        lo, hi = w["interval"]
        lines.append(f"**Winner: {w['name']}** — {w['measured_tokens_per_s']:,.0f} tokens/s/device "
                     f"(95 % interval {_rate(lo)}–{_rate(hi)}); predicted {w['predicted_tokens_per_s']:,.0f} "
                     f"({w['prediction_error']:+.0%}).")
    else:
        lines.append("**No winner**: no measured member finished.")
    g = record["grid"]
    lines += ["", f"{g['candidates']} candidates on {record['world']} ranks (search: {', '.join(record['search'])}), "
                  f"{g['fit']} fit in memory; times from {record['profile']}. Machine time: {record['spent_s']:.0f} s "
                  f"({record['spent_device_s']:.0f} device-s) vs about {g['estimated_s']:.0f} s for the whole grid "
                  f"({record['spent_s'] / g['estimated_s']:.0%}). Stopped: {record['stopped']}.", "",
              "| candidate | predicted tok/s/dev | measured tok/s/dev (95 %) | error | predicted GiB "
              "| model: compute / comm / bubble / recompute s | rounds | outcome |",
              "|---|---|---|---|---|---|---|---|"]
    measured = [c for c in record["candidates"] if c["measured_tokens_per_s"]]
    rest = [c for c in record["candidates"] if not c["measured_tokens_per_s"]]
    for c in sorted(measured, key=lambda c: -c["measured_tokens_per_s"]) + rest:
        b = c["predicted_breakdown_s"]
        m = (f"{c['measured_tokens_per_s']:,.0f} ({_rate(c['interval'][0])}–{_rate(c['interval'][1])})"
             if c["measured_tokens_per_s"] else "")
        err = f"{c['prediction_error']:+.0%}" if c["prediction_error"] is not None else ""
        outcome = "winner" if w and c["name"] == w["name"] else c["pruned"]
        lines.append(f"| {c['name']} | {c['predicted_tokens_per_s']:,.0f} | {m} | {err} | {c['predicted_memory_gib']:.2f} "
                     f"| {b['compute']:.3f} / {b['exposed_comm']:.3f} / {b['bubble']:.3f} / {b['recompute']:.3f} "
                     f"| {len(c['members'])} | {outcome} |")
    r = record.get("refit")
    if r:
        lines += ["", f"Profile refit to this sweep's measured members: median step-time error "
                      f"{r['median_error_before']:.0%} -> {r['median_error_after']:.0%} ({r['profile']})."]
    return "\n".join(lines) + "\n"
