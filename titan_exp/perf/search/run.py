"""A training run planned, not one step: for each GPU count a cluster offers (whole nodes, doubling
up to a maximum), the fastest layout that fits at one global batch (planner.fastest_fitting, at
each combination of the other axes `autotune.search` names), its tokens/s for the whole job, the
days to train a number of tokens, the GPU-hours and their cost, and the tokens/s per GPU lost to
scale, each with the band of the plan's quoted error; the fewest GPUs that meet a deadline and the
cheapest count are marked. `python -m titan_exp.perf.plan --tokens 15T` prints it (perf.plan
dispatches here, and prints the launch line of the count picked).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from titan_exp.config import AutotuneAxis, JobConfig
from titan_exp.perf.rates.profile import MachineProfile
from titan_exp.perf.search.axes import variants
from titan_exp.perf.search.planner import Plan, fastest_fitting, plan_of

DAY_S = 86_400
SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
MAX_GPUS = 1024  # the most GPUs a run is planned at unless --max-gpus says


def parse_tokens(text: str) -> int:
    """A token count as people write it: 15T, 500B, 2.5t, 1e12, 15_000_000_000_000."""
    raw = text.strip().upper().replace("_", "").replace(",", "")
    scale = SUFFIXES.get(raw[-1:], 1.0)
    try:
        value = float(raw[:-1] if raw[-1:] in SUFFIXES else raw) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count: write it as 15T, 500B, 2.5T or 1e12")
    return round(value)


def parse_batches(text: str) -> tuple[int, int]:
    """A global batch in sequences, or a range of them: `1024`, `512-2048`."""
    low, dash, high = text.partition("-")
    try:
        lo, hi = int(low), int(high if dash else low)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not a global batch in sequences: write 1024, or a range "
                                         "LO-HI such as 512-2048")
    return lo, hi


def add_flags(cli: argparse.ArgumentParser) -> None:
    """The flags of a run plan, on the plan's command line."""
    cli.add_argument("--tokens", type=parse_tokens, default=None, help="plan a training run of this many tokens "
                     "(15T, 500B, 1e12) at each GPU count the cluster offers, instead of one step at --world")
    cli.add_argument("--max-gpus", type=int, default=None, help=f"with --tokens: the most GPUs (default {MAX_GPUS})")
    cli.add_argument("--min-gpus", type=int, default=None, help="with --tokens: the fewest (default one node)")
    cli.add_argument("--days", type=float, default=None, help="with --tokens: the deadline; the fewest GPUs "
                     "predicted to meet it are marked and picked")
    cli.add_argument("--gpu-hour-price", type=float, default=None, help="with --tokens: price of a GPU-hour")
    cli.add_argument("--global-batch", type=parse_batches, default=None, metavar="N|LO-HI",
                     help="with --tokens: the global batch in sequences, or a range: at each count the smallest "
                     "of LO, 2 LO, 4 LO, ... up to HI that some layout fits (default training.global_batch_size)")
    cli.add_argument("--pick", type=int, default=None, metavar="GPUS", help="with --tokens: the count to print "
                     "the launch line (or --write-sweep) of; default the fewest that meet --days, else the cheapest")
    cli.add_argument("--out", default=None, help="with --tokens: the plot's file (default ./run_MODEL_TOKENS.png)")


RUN_ONLY = ("max_gpus", "min_gpus", "days", "gpu_hour_price", "global_batch", "pick", "out")


def refusal(args: argparse.Namespace, job: JobConfig) -> str | None:
    """Why these flags do not make a run plan (or a step plan, for a run's flags without --tokens)."""
    given = [f"--{k.replace('_', '-')}" for k in RUN_ONLY if getattr(args, k) is not None]
    if args.tokens is None:
        return f"{given[0]} describes a run: add --tokens N (e.g. --tokens 15T)" if given else None
    if args.world is not None:
        return "--world plans one step on that many devices, --tokens a run at every count: give one of them"
    if not (args.device or args.hardware):
        return "--tokens plans a run on a cluster: name its GPUs with --device NAME (and --gpus-per-node) or --hardware"
    if args.keep_split:
        return "--keep-split plans one step at the configured local batch; a run plan takes each count's fastest split"
    for flag, value in (("--days", args.days), ("--gpu-hour-price", args.gpu_hour_price)):
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"{flag} {value}: must be a positive number"
    if job.training.global_batch_size == -1 and args.global_batch is None:
        tokens = 512 * job.training.seq_len
        return ("training.global_batch_size is -1 (the local batch on every data-parallel rank, so it grows with "
                "the GPUs): a run keeps one global batch at every count; set it (e.g. training.global_batch_size=512, "
                f"{tokens:,} tokens at seq {job.training.seq_len:,}) or give --global-batch LO-HI")
    if job.training.global_batch_size != -1 and args.global_batch is not None:
        return (f"--global-batch and training.global_batch_size={job.training.global_batch_size} both set the "
                "global batch; keep one")
    return None


def gpu_counts(gpus_per_node: int, max_gpus: int, min_gpus: int | None = None) -> list[int]:
    """The GPU counts a run is planned at: whole nodes, doubling (1, 2, 4, ... nodes: a layout's
    degrees divide them, as they divide heads, layers and batch), from `min_gpus` up to `max_gpus`."""
    low = min_gpus or gpus_per_node
    if max_gpus < low:
        raise ValueError(f"--max-gpus {max_gpus}: fewer than {low} (one node of {gpus_per_node}, or --min-gpus); "
                         "raise it")
    out = [gpus_per_node * 2**k for k in range(max(0, (max_gpus // gpus_per_node).bit_length()))]
    out = [n for n in out if low <= n <= max_gpus]
    if min_gpus is not None and min_gpus not in out:
        raise ValueError(f"--min-gpus {min_gpus}: not a count the plan takes (nodes of {gpus_per_node}, doubling: "
                         f"{', '.join(map(str, out[:4] or [gpus_per_node]))}, ...); pick one of them")
    return out


def batch_choices(job: JobConfig, given: tuple[int, int] | None) -> list[int]:
    """The global batches a count may take, in the order tried: the job's own, or LO, 2 LO, ... up to HI."""
    lo, hi = given or (job.training.global_batch_size,) * 2
    return [lo * 2**k for k in range((hi // lo).bit_length())]


@dataclass
class Question:
    """What a run plan is asked: the tokens, the GPU counts, the global batches each may take, the
    deadline, the price of a GPU-hour, the count to launch, and where the plot goes."""

    tokens: int
    counts: list[int]
    batches: list[int]
    gpus_per_node: int
    max_gpus: int
    deadline: float | None = None
    price: float | None = None
    pick: int | None = None
    out: Path | None = None


def question(args: argparse.Namespace, job: JobConfig, gpus_per_node: int) -> Question:
    """The run plan the flags ask for (ValueError, naming the flag, where they do not make one)."""
    most = args.max_gpus or MAX_GPUS
    counts = gpu_counts(gpus_per_node, most, args.min_gpus)
    if args.pick is not None and args.pick not in counts:
        raise ValueError(f"--pick {args.pick}: not a count of this plan; pick one of {', '.join(map(str, counts))}")
    out = Path(args.out) if args.out else Path(f"run_{job.model.flavor}_{short(args.tokens)}.png")
    return Question(args.tokens, counts, batch_choices(job, args.global_batch), gpus_per_node, most, args.days,
                    args.gpu_hour_price, args.pick, out)


@dataclass
class Row:
    """One GPU count: the fastest layout that fits there (`plan`), or why none does."""

    gpus: int
    nodes: int
    global_batch: int
    plan: Plan | None = None
    why_not: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Tokens/s of the whole job: per device, times the GPUs."""
        return self.plan.tokens_per_s * self.gpus if self.plan else 0.0


def search(job: JobConfig, world: int, profile: MachineProfile, memory_gib: float, batches: list[int],
           axes: Iterable[AutotuneAxis] = ()) -> Row:
    """The fastest layout of `world` GPUs that fits in `memory_gib`, at the first of `batches` some
    layout fits, each layout at its fastest split and each combination of the other `axes`."""
    why = ""
    for batch in batches:
        at = dataclasses.replace(job, training=dataclasses.replace(job.training, global_batch_size=batch))
        best = None
        for variant, settings in variants(at, axes, cuda=True):
            answer = fastest_fitting(variant, world, cuda=True, memory_gib=memory_gib, profile=profile)
            if answer.job is not None and (best is None or answer.step_s < best[0].step_s):
                best = answer, settings, variant
            elif answer.job is None and best is None:
                why = (f"no layout of {world} GPUs takes a global batch of {batch}" if not answer.valid else
                       f"none of its {answer.valid} layouts fits at global batch {batch}: the least needs "
                       f"{answer.least_gib:.1f} GiB ({answer.least_layout})")
        if best is not None:
            answer, settings, variant = best
            own = (variant.activation_checkpoint, variant.compile, variant.precision) == (
                job.activation_checkpoint, job.compile, job.precision)
            chosen = plan_of(answer.job, profile, cuda=True, device_memory_gib=memory_gib, settings=settings,
                             configured=own)
            return Row(world, chosen.nodes, batch, chosen)
    return Row(world, job.cluster.nnodes, batches[-1], why_not=why)


def plan_run(counts: list[int], at: Callable[[int], tuple[JobConfig, MachineProfile, float]], batches: list[int],
             axes: Iterable[AutotuneAxis] = (), workers: int | None = None) -> list[Row]:
    """A row per GPU count; `at(gpus)` gives the job on that many GPUs, their profile and memory.
    The counts are searched at once in `workers` forked processes (default: one per CPU), the
    largest first; one by one where there is one CPU or no fork."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    setups = {gpus: at(gpus) for gpus in counts}
    workers = min(len(counts), os.cpu_count() or 1) if workers is None else workers
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [search(job, gpus, profile, memory, batches, axes) for gpus, (job, profile, memory) in setups.items()]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {gpus: pool.submit(search, job, gpus, profile, memory, batches, tuple(axes))
                   for gpus, (job, profile, memory) in sorted(setups.items(), reverse=True)}
        return [futures[gpus].result() for gpus in counts]


# -- the arithmetic of a run ---------------------------------------------------------------------
def days(tokens: int, tokens_per_s: float) -> float:
    """Days to train `tokens` at the whole job's `tokens_per_s`."""
    return tokens / (tokens_per_s * DAY_S)


def gpu_hours(days_: float, gpus: int) -> float:
    return days_ * 24 * gpus


def band(value: float, error: float | None) -> tuple[float, float]:
    """The range of a time (or of what scales with it) when tokens/s is off by `error` either way:
    value / (1 + error) to value / (1 - error); unbounded above at an error of 100 % or more."""
    if error is None:
        return value, value
    return value / (1 + error), value / (1 - error) if error < 1 else math.inf


def efficiency(row: Row, base: Row) -> float:
    """Tokens/s per GPU at `row` against `base`'s (the smallest count that fits)."""
    return (row.tokens_per_s / row.gpus) / (base.tokens_per_s / base.gpus)


def fewest_meeting(rows: list[Row], tokens: int, deadline: float | None) -> Row | None:
    """The fewest GPUs predicted to train `tokens` within `deadline` days."""
    if deadline is None:
        return None
    return next((r for r in rows if r.plan and days(tokens, r.tokens_per_s) <= deadline), None)


def cheapest(rows: list[Row], tokens: int) -> Row | None:
    """The count predicted to spend the fewest GPU-hours (the fewest GPUs of those tied)."""
    planned = [r for r in rows if r.plan]
    return min(planned, key=lambda r: (round(gpu_hours(days(tokens, r.tokens_per_s), r.gpus), 6), r.gpus),
               default=None)


def picked(rows: list[Row], q: Question) -> tuple[Row | None, str]:
    """The row to launch and why: --pick's, the fewest GPUs that meet the deadline, the fastest when
    none does, else the cheapest."""
    if q.pick is not None:
        row = next(r for r in rows if r.gpus == q.pick)
        if row.plan is None:
            raise ValueError(f"--pick {q.pick}: no layout fits there; pick one of "
                             f"{', '.join(str(r.gpus) for r in rows if r.plan)}")
        return row, f"{q.pick} GPUs (--pick)"
    meets = fewest_meeting(rows, q.tokens, q.deadline)
    if meets is not None:
        return meets, f"{meets.gpus} GPUs, the fewest that meet {q.deadline:g} days (--pick N for another)"
    if q.deadline is not None:
        fast = max((r for r in rows if r.plan), key=lambda r: r.tokens_per_s, default=None)
        return fast, f"{fast.gpus} GPUs, the fastest (none meets {q.deadline:g} days)" if fast else ""
    cheap = cheapest(rows, q.tokens)
    return cheap, f"{cheap.gpus} GPUs, the cheapest (--days or --pick N for another)" if cheap else ""


def steps(tokens: int, row: Row, seq_len: int) -> int:
    """The optimizer steps that train `tokens` at `row`'s global batch."""
    return math.ceil(tokens / (row.global_batch * seq_len))


def with_steps(overrides: list[str], q: Question, row: Row, job: JobConfig) -> list[str]:
    """`overrides` with training.steps set to train the tokens at `row` (in place of any given)."""
    key = "training.steps="
    return [*(o for o in overrides if not o.lstrip("+").startswith(key)),
            f"{key}{steps(q.tokens, row, job.training.seq_len)}"]


# -- how a run reads ---------------------------------------------------------------------------
def short(n: float) -> str:
    """A number in three figures: 1.46M, 512k, 37.2."""
    if math.isinf(n):
        return "inf"
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def spread(value: float, error: float | None, money: str = "") -> str:
    """`value` with its band: 13.0 (11.2-15.4)."""
    lo, hi = band(value, error)
    return f"{money}{short(value)} ({money}{short(lo)}-{money}{short(hi)})" if error else f"{money}{short(value)}"


def table(rows: list[Row], tokens: int, error: float | None, price: float | None, deadline: float | None,
          ranged: bool = False) -> str:
    """The run at each count as a markdown table; days, GPU-hours and cost with their band."""
    base = next((r for r in rows if r.plan), None)
    meets, cheap = fewest_meeting(rows, tokens, deadline), cheapest(rows, tokens)
    head = ["GPUs", "nodes", *(["global batch"] if ranged else []), "layout", "batch split", "tokens/s", "days",
            "GPU-hours", *(["cost"] if price else []), f"per GPU vs {base.gpus if base else '-'}", "mark"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r.gpus), str(r.nodes), *([str(r.global_batch)] if ranged else [])]
        if r.plan is None:
            cells += [r.why_not, *[""] * (len(head) - len(cells) - 1)]
        else:
            d = days(tokens, r.tokens_per_s)
            hours = gpu_hours(d, r.gpus)
            marks = [m for m, row in (("meets deadline", meets), ("cheapest", cheap)) if row is r]
            cells += [r.plan.name, r.plan.split, f"{r.tokens_per_s:,.0f}", spread(d, error), spread(hours, error),
                      *([spread(hours * price, error, "$")] if price else []), f"{efficiency(r, base):.0%}",
                      ", ".join(marks)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(q: Question, rows: list[Row], job: JobConfig, device: str, rates: str,
           accuracy: tuple[float | None, str]) -> list[str]:
    """The run plan as printed under the plan's first line: what it takes, the rates and their
    quoted error, the table, the deadline's and the cheapest count's lines, and the plot written."""
    error, where = accuracy
    seq, batches = job.training.seq_len, q.batches
    batch = (f"global batch {batches[0]:,} sequences ({batches[0] * seq:,} tokens) at every count, from "
             "training.global_batch_size" if len(batches) == 1 else
             f"at each count the smallest global batch of {', '.join(map(str, batches))} sequences that fits")
    c = q.counts
    shown = ", ".join(map(str, c)) if len(c) <= 4 else f"{c[0]}, {c[1]}, ..., {c[-1]}"
    out = q.out or Path("run.png")
    written = plot(rows, q, error, out, f"{job.model.flavor}, {short(q.tokens)} tokens on {device.split()[0]}")
    return [f"run: {short(q.tokens)} tokens, {batch}",
            f"GPUs: {shown} of {device}: whole nodes of {q.gpus_per_node}, doubling (layout degrees divide "
            f"them) to --max-gpus {q.max_gpus}",
            rates, band_line(error, where),
            table(rows, q.tokens, error, q.price, q.deadline, ranged=len(batches) > 1),
            *summary(rows, q.tokens, error, q.price, q.deadline),
            f"plot: {written}" if written.suffix == ".png" else
            f"matplotlib is not installed: wrote the plot's numbers to {written}"]


def band_line(error: float | None, where: str) -> str:
    """The caveat: the quoted error, and that the ranges are of it."""
    if error is None:
        return f"accuracy: unknown ({where}); days and cost are shown without a range"
    return f"accuracy: tokens/s off by {error:.0%} at the median {where}; the ranges below span that error"


def summary(rows: list[Row], tokens: int, error: float | None, price: float | None,
            deadline: float | None) -> list[str]:
    """The deadline's and the cheapest count's lines under the table."""
    out = []
    meets, cheap = fewest_meeting(rows, tokens, deadline), cheapest(rows, tokens)
    if deadline is not None:
        if meets is None:
            out.append(f"deadline: no count up to {rows[-1].gpus} GPUs is predicted to train {short(tokens)} tokens "
                       f"in {deadline:g} days")
        else:
            d = days(tokens, meets.tokens_per_s)
            slow = band(d, error)[1]
            out.append(f"deadline: {meets.gpus} GPUs are the fewest predicted to meet {deadline:g} days: "
                       f"{spread(d, error)} days, its slow end {'meets it too' if slow <= deadline else 'does not'}")
    if cheap is not None:
        hours = gpu_hours(days(tokens, cheap.tokens_per_s), cheap.gpus)
        cost = f", {spread(hours * price, error, '$')} at ${price:g} an hour" if price else ""
        out.append(f"cheapest: {cheap.gpus} GPUs, {spread(hours, error)} GPU-hours{cost}")
    return out


def plot(rows: list[Row], q: Question, error: float | None, path: Path, title: str) -> Path:
    """Days and cost (GPU-hours without a price) against GPUs, each with its band: a PNG with
    matplotlib, else the same numbers as a CSV beside where the PNG would be."""
    tokens, price, deadline = q.tokens, q.price, q.deadline
    planned = [r for r in rows if r.plan]
    gpus = [r.gpus for r in planned]
    d = [days(tokens, r.tokens_per_s) for r in planned]
    spend = [gpu_hours(x, r.gpus) * (price or 1) for x, r in zip(d, planned)]
    try:
        import matplotlib
    except ImportError:
        return write_csv(path.with_suffix(".csv"), gpus, d, spend, error, "cost" if price else "gpu_hours")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, values, label in ((axes[0], d, "days"), (axes[1], spend, "cost" if price else "GPU-hours")):
        ax.plot(gpus, values, marker="o")
        ax.fill_between(gpus, *zip(*(band(v, error) for v in values)), alpha=0.25,
                        label=f"tokens/s off by {error:.0%}" if error else None)
        ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel=label)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.grid(True, which="both", alpha=0.3)
    if deadline is not None:
        axes[0].axhline(deadline, color="grey", linestyle="--", label=f"{deadline:g} days")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_csv(path: Path, gpus: list[int], days_: list[float], spend: list[float], error: float | None,
              what: str) -> Path:
    import csv

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["gpus", "days", "days_low", "days_high", what, f"{what}_low", f"{what}_high"])
        for g, x, s in zip(gpus, days_, spend):
            out.writerow([g, x, *band(x, error), s, *band(s, error)])
    return path
