"""A sweep directory -> report.md, report.csv and plots: which member was fastest, and why the
others were not.

    python -m titan_exp.report <sweep dir>

A sweep dir is what `python launch.py -m ...` writes: one run dir per member (Hydra's
`<sweep dir>/<N>/`), each with `.hydra/overrides.yaml` and, once it ran (or was refused),
`summary.json`. A member without a summary is `pending`; one whose summary says `running` is still
going (or was requeued). So the report works on a sweep that is partly done. A member submitted to
SLURM is brought up to date with its job's state first (a cancelled job shows as `cancelled`).
It also runs by itself at the end of a local multirun (`ReportCallback`, wired in conf/config.yaml).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import logging
from pathlib import Path
from typing import Any, Callable

import yaml
from hydra.experimental.callback import Callback

from titan_exp.config import Converter, JobConfig, PrecisionConfig, layout_label, load_job_config
from titan_exp.files import atomic_write
from titan_exp.record import RunDir, RunSummary, Status, sweep_members

logger = logging.getLogger("titan_exp.report")

# report.csv's columns; a column no member has a value in is left out (KEPT always stays).
COLUMNS = ("member", "overrides", "layout", "global_batch_size", "seq_len", "precision", "ep", "expert_load",
           "compile", "activation_checkpoint", "world_size", "tokens_per_second_per_device",
           "tokens_per_second_per_device_mean", "mfu", "peak_memory_gib", "final_loss", "final_val_loss",
           "status", "reason",
           "predicted_tokens_per_second_per_device", "prediction_error", "prediction_source", "compute_share",
           "exposed_comm_share",
           "bubble_share", "recompute_share", "breakdown_source")
SHARES = ("compute", "exposed_comm", "bubble", "recompute")
# Where a row's predicted numbers come from (MachineProfile.source); every other number is measured.
PREDICTION_SOURCES = {"calibrated": "measured profile", "spec": "spec sheet", "defaults": "default costs"}
KEPT = ("member", "overrides", "status")


def members(sweep: Path) -> list[Path]:
    """The member run dirs of a sweep: the subdirectories Hydra gave a job number."""
    return [run_dir.path for run_dir in sweep_members(sweep)]


def row(path: Path) -> dict[str, Any]:
    run_dir = RunDir(path)
    overrides = yaml.safe_load(run_dir.overrides.read_text()) or []
    summary = run_dir.read_summary() or RunSummary(status=Status.pending)
    if run_dir.slurm_job.exists():  # a SLURM job: its state may say more than its summary
        from titan_exp.cluster.slurm import refresh

        summary = refresh(run_dir) or summary

    def shown(value: Any) -> Any:
        return "" if value is None else value

    job = load_job_config(run_dir.config) if run_dir.config.exists() else None
    error = summary.error or ""
    return {
        "member": path.name,
        "all_overrides": overrides,
        "layout": layout_label(summary.layout),
        # Sequences a step takes (an invalid member's -1, "local x dp", was never worked out).
        "global_batch_size": summary.global_batch_size if (summary.global_batch_size or 0) > 0 else None,
        "seq_len": summary.seq_len,
        # MoE runs: the expert parallel degree, and the busiest expert's tokens over the mean at the end.
        "ep": (summary.layout or {}).get("ep", 1) if summary.expert_load is not None else "",
        "expert_load": summary.expert_load["max_load"] if summary.expert_load else None,
        "precision": precision_label(job.precision) if job else shown(summary.precision),
        "compile": shown(summary.compile),
        "activation_checkpoint": shown(summary.activation_checkpoint),
        "world_size": shown(summary.world_size),
        "tokens_per_second_per_device": summary.tokens_per_second_per_device,
        "tokens_per_second_per_device_mean": summary.tokens_per_second_per_device_mean,
        "mfu": summary.mfu,
        "peak_memory_gib": summary.peak_memory_gib,
        "final_loss": summary.final_loss,
        "final_val_loss": summary.final_val_loss,
        "status": summary.status.value,
        "reason": error.splitlines()[0][:300] if error else "",
        "losses": summary.losses or [],
        "per_source": per_source(summary),
        **eval_columns(summary),
        **(prediction(run_dir, job, summary.tokens_per_second_per_device) if job else {}),
    }


def precision_label(p: PrecisionConfig) -> str:
    """The preset's name, and the dtypes the run computed and reduced in where the name does not
    say them: 'fp32', 'bf16 (fp32 reduce)', 'fp32 (bf16 compute, fp32 reduce)' for fp32 with
    precision.param_dtype=bfloat16 set."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    compute, reduce = (short.get(d.value, d.value) for d in (p.param_dtype, p.reduce_dtype))
    parts = [f"{compute} compute"] if compute != p.name.removeprefix("full_") else []
    parts += [f"{reduce} reduce"] if reduce != compute else []
    if p.converter != Converter.none and p.converter.value not in p.name:
        parts.insert(0, f"{p.converter.value} linears")
    return f"{p.name} ({', '.join(parts)})" if parts else p.name


def per_source(summary: RunSummary) -> dict[str, Any]:
    """A mixture's numbers per source (data.mixture): tokens trained on and the last held-out loss."""
    return {**{f"tokens {k}": v for k, v in (summary.tokens_per_source or {}).items()},
            **{f"val_loss {k}": v for k, v in (summary.val_loss_per_source or {}).items()}}


def eval_columns(summary: RunSummary) -> dict[str, float]:
    """The member's evaluation (eval.enable) as one column per number: `eval/<task>/<metric>`."""
    return {f"eval/{task}/{metric}": value for task, row in (summary.eval or {}).items()
            for metric, value in row.items()}


def _eval_keys(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith("eval/")})


def _eval_cell(r: dict[str, Any]) -> str:
    """The evaluation's metrics (standard errors left to report.csv): `task/metric value, ...`."""
    return ", ".join(f"{k.removeprefix('eval/')} {r[k]:.4f}" for k in _eval_keys([r]) if not k.endswith("_stderr"))


@functools.lru_cache(maxsize=None)
def _profile(world: int, cuda: bool, nodes: int):
    from titan_exp.perf.rates.profile import this_machine

    return this_machine(world, cuda=cuda, nodes=nodes)


def prediction(run_dir: RunDir, job: JobConfig, measured: float | None) -> dict[str, Any]:
    """What the performance model predicted for a member (with this machine's profile) and where
    its step time went: from its profiler trace when profiling was on (rank 0's last traced step;
    recompute from the model, which a trace cannot separate), else from the model."""
    from titan_exp.perf.model.step import predict_step
    from titan_exp.train.trace import latest_trace, step_breakdown
    from titan_exp.validation import ranks_have_gpus

    cuda = ranks_have_gpus(job)
    profile = _profile(job.world_size, cuda, job.cluster.nnodes)
    step = predict_step(job, profile, cuda=cuda)
    parts, source = step.breakdown(), "model"
    trace = latest_trace(run_dir.path, job.profiling.save_traces_folder)
    traced = step_breakdown(trace) if trace else None
    if traced:
        parts = {"compute": traced["compute"], "exposed_comm": traced["exposed_comm"],
                 "bubble": traced["p2p_and_bubble"], "recompute": parts["recompute"] * traced["step_s"] / step.step_s}
        parts["compute"] = max(0.0, parts["compute"] - parts["recompute"])
        source = f"trace ({trace.parent.name}, rank 0)"
    total = sum(parts.values()) or 1.0
    return {
        "predicted_tokens_per_second_per_device": step.tokens_per_s_per_device,
        "prediction_error": step.tokens_per_s_per_device / measured - 1 if measured else None,
        "prediction_source": PREDICTION_SOURCES.get(profile.source, profile.source),
        **{f"{k}_share": parts[k] / total for k in SHARES},
        "breakdown_source": source,
    }


def distinguishing(rows: list[dict[str, Any]]) -> None:
    """Set each row's `overrides` to those of its overrides that are not common to every member."""
    common = set.intersection(*(set(r["all_overrides"]) for r in rows)) if rows else set()
    for r in rows:
        r["overrides"] = " ".join(o for o in r["all_overrides"] if o not in common) or "(base)"


def ranked(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Finished members by throughput, fastest first; then the rest, by status."""
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: -(r["tokens_per_second_per_device"] or 0))
    rest = sorted((r for r in rows if r["status"] != "ok"), key=lambda r: (r["status"], r["member"]))
    return ok + rest


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or value == "":
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out


def tally(rows: list[dict[str, Any]]) -> str:
    return ", ".join(f"{n} {status}" for status, n in sorted(counts(rows).items()))


# report.md's columns after the rank: (header, the cell of a row).
MARKDOWN_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("member", lambda r: r["member"]),
    ("overrides", lambda r: r["overrides"]),
    ("layout", lambda r: r["layout"]),
    ("global batch (sequences)", lambda r: _fmt(r["global_batch_size"])),
    ("seq len", lambda r: _fmt(r["seq_len"])),
    ("precision", lambda r: r["precision"]),
    ("EP", lambda r: _fmt(r["ep"])),
    ("max expert load", lambda r: _fmt(r["expert_load"], 2)),
    ("compile", lambda r: _fmt(r["compile"])),
    ("AC", lambda r: _fmt(r["activation_checkpoint"])),
    ("world", lambda r: _fmt(r["world_size"])),
    ("tokens/s/device", lambda r: _fmt(r["tokens_per_second_per_device"])),
    ("MFU %", lambda r: _fmt(r["mfu"])),
    ("peak GiB/device", lambda r: _fmt(r["peak_memory_gib"], 3)),
    ("final loss", lambda r: _fmt(r["final_loss"], 4)),
    ("val loss", lambda r: _fmt(r["final_val_loss"], 4)),
    ("eval", lambda r: _eval_cell(r)),
    ("status", lambda r: r["status"]),
    ("reason", lambda r: r["reason"].replace("|", "/")),
    ("predicted tokens/s (error)", lambda r: _predicted(r)),
    ("step: compute / comm / bubble / recompute % (from)", lambda r: _shares(r)),
)


def filled(header: list[str], table: list[list[str]]) -> tuple[list[str], list[list[str]]]:
    """The columns some row has a value in (and KEPT): a dense sweep has no EP column."""
    keep = [j for j, name in enumerate(header) if name in KEPT or any(cells[j] != "" for cells in table)]
    return [header[j] for j in keep], [[cells[j] for j in keep] for cells in table]


# What makes a step of one member unlike a step of another: (row key, what, unit, the field that fixes it).
STEP_SIZE = (("global_batch_size", "global batch", "sequences", "training.global_batch_size"),
             ("seq_len", "sequence length", "tokens", "training.seq_len"))


def differences(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(what differs with its values, the field that fixes it) for each of STEP_SIZE the members
    differ in: ('global batch 8 / 16 sequences', 'training.global_batch_size')."""
    out = []
    for key, what, unit, field in STEP_SIZE:
        values = sorted({r[key] for r in rows if r.get(key)})
        if len(values) > 1:
            out.append((f"{what} {' / '.join(str(v) for v in values)} {unit}", field))
    return out


def comparison_warning(rows: list[dict[str, Any]]) -> str:
    """One line for a sweep whose members do different work per step; '' when they do not."""
    diffs = differences(rows)
    if not diffs:
        return ""
    return (f"**Members differ in {' and '.join(d for d, _ in diffs)}**: a step is different work in each, so "
            "their losses at a step (loss.png, final loss) do not compare, nor do their tokens/s like for like. "
            f"Set {' and '.join(f'`{f}=`' for _, f in diffs)} in the sweep to compare them at one.")


def to_markdown(rows: list[dict[str, Any]], sweep: Path) -> str:
    table = [[str(i) if r["status"] == "ok" else "", *(cell(r) for _, cell in MARKDOWN_COLUMNS)]
             for i, r in enumerate(rows, 1)]
    header, table = filled(["rank", *(name for name, _ in MARKDOWN_COLUMNS)], table)
    warning = comparison_warning(rows)
    lines = [f"# Sweep {sweep}", "", *([warning, ""] if warning else []),
             f"{len(rows)} members: {tally(rows)}. Ranked by tokens/s per device of the median steady step (the "
             "first `metrics.warmup_steps` steps left out; report.csv has the mean as "
             "tokens_per_second_per_device_mean).", "",
             "| " + " | ".join(header) + " |", "|---" * len(header) + "|",
             *("| " + " | ".join(cells) + " |" for cells in table)]
    lines += ["", "Plots: `throughput.png`, `memory.png`, `loss.png`. Predictions: titan_exp.perf.model.step with this "
              "machine's profile, each marked with where its costs came from: [measured profile] (`python -m "
              "titan_exp.perf.calibrate`), [spec sheet] or [default costs]; error = predicted / measured - 1. Every "
              "other column is measured."]
    lines += per_source_table(rows)
    autotune = sweep / "autotune.md"
    if autotune.exists():  # an autotune sweep's own record comes first
        lines = [*lines[:2], autotune.read_text(), *lines[2:]]
    return "\n".join(lines) + "\n"


def source_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The per-source columns any member has, in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r.get("per_source", {})))


def per_source_table(rows: list[dict[str, Any]]) -> list[str]:
    columns = source_columns(rows)
    if not columns:
        return []
    return ["", "Per data source (data.mixture): tokens trained on, and the held-out loss at the last validation.", "",
            "| member | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|",
            *("| " + " | ".join([r["member"], *(_fmt(r["per_source"].get(c), 4) for c in columns)]) + " |"
              for r in rows)]


def _predicted(r: dict[str, Any]) -> str:
    if r.get("predicted_tokens_per_second_per_device") is None:
        return ""
    error = f" ({r['prediction_error']:+.0%})" if r.get("prediction_error") is not None else ""
    source = f" [{r['prediction_source']}]" if r.get("prediction_source") else ""
    return f"{r['predicted_tokens_per_second_per_device']:.1f}{error}{source}"


def _shares(r: dict[str, Any]) -> str:
    if r.get("breakdown_source") is None:
        return ""
    return " / ".join(f"{100 * r[f'{k}_share']:.0f}" for k in SHARES) + f" ({r['breakdown_source']})"


def to_csv(rows: list[dict[str, Any]]) -> str:
    flat = [{**r, **r.get("per_source", {})} for r in rows]
    columns = [c for c in (*COLUMNS, *source_columns(rows), *_eval_keys(rows))
               if c in KEPT or any(r.get(c) not in (None, "") for r in flat)]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(flat)
    return out.getvalue()


def plot(rows: list[dict[str, Any]], sweep: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    written = []
    labels = [f"{r['member']}: {r['overrides']}"[:60] for r in ok]
    for name, key, xlabel in (("throughput", "tokens_per_second_per_device", "tokens/s per device"),
                              ("memory", "peak_memory_gib", "peak memory per device (GiB)")):
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(ok) + 1.5))
        ax.barh(labels[::-1], [r[key] or 0 for r in ok][::-1])
        ax.set_xlabel(xlabel)
        ax.set_title(f"{xlabel} by member ({len(ok)} ok of {len(rows)})")
        fig.tight_layout()
        written.append(sweep / f"{name}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    written.append(plot_losses(ok, sweep / "loss.png"))
    return written


def plot_losses(ok: list[dict[str, Any]], path: Path) -> Path:
    """The members' loss by step. Where they differ in global batch or sequence length, a step is
    not the same work: the title says so in red (and the PNG's Title text), and each curve's label
    names its batch."""
    import matplotlib.pyplot as plt

    diffs = differences(ok)
    title = (f"Not comparable step for step: members differ in {' and '.join(d for d, _ in diffs)}" if diffs
             else "loss by step")
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in ok:
        label = f"{r['member']}: {r['overrides']}"[:60]
        if diffs:
            label += f" (global batch {r['global_batch_size']} x seq {r['seq_len']})"
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, color="tab:red" if diffs else "black", fontsize="medium", wrap=True)
    if ok:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": title})
    plt.close(fig)
    return path


def write_report(sweep: Path, *, plots: bool = True) -> list[dict[str, Any]]:
    """Write report.md, report.csv (and the plots) into `sweep`; returns the ranked rows."""
    sweep = Path(sweep)
    rows = [row(d) for d in members(sweep)]
    distinguishing(rows)
    rows = ranked(rows)
    atomic_write(sweep / "report.md", to_markdown(rows, sweep))
    atomic_write(sweep / "report.csv", to_csv(rows))
    if plots:
        plot(rows, sweep)
    return rows


def sweep_exit_code(sweep: Path) -> int:
    """0 when every member of the sweep finished ok or is queued/running on SLURM, else 1; read
    from the members' run records, like the report."""
    statuses = [(r.read_summary() or RunSummary(status=Status.pending)).status for r in sweep_members(sweep)]
    return 0 if statuses and all(s in (Status.ok, Status.pending, Status.running) for s in statuses) else 1


class ReportCallback(Callback):
    """At the end of a multirun: the report, and one line saying how many members succeeded."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        if not sweep.is_dir():
            return
        rows = write_report(sweep)
        ok = counts(rows).get("ok", 0)
        logger.info("sweep %s: %d of %d members ok (%s); report %s", sweep, ok, len(rows), tally(rows),
                    sweep / "report.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_exp.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="a sweep directory (python launch.py -m ... wrote it)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if not args.sweep.is_dir() or not members(args.sweep):
        parser.error(f"{args.sweep} holds no sweep members (subdirectories with .hydra/overrides.yaml)")
    rows = write_report(args.sweep, plots=not args.no_plots)
    print(to_markdown(rows, args.sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
