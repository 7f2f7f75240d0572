"""The run record: the directory every run leaves, and its typed summary. This module is the one
writer and reader of a run's files; the launcher, the ranks, the SLURM follower and the report all
go through it.

    <run dir>/config.yaml      the resolved config the ranks were built from
    <run dir>/tokenizer.json   the tokenizer the run used (a copy, so the run is self-contained)
    <run dir>/metrics.jsonl    one line per logged step
    <run dir>/summary.json     a RunSummary: status, throughput, MFU, memory, losses; always written
    <run dir>/logs/rank-K.log  each rank's log
    <run dir>/slurm_job.json   the SLURM job (id, log paths, code snapshot), cluster=slurm only
    <run dir>/layouts.json     cluster.elastic: every layout the run used, from which step (LayoutSpan)
    <run dir>/checkpoints/step-N/   DCP checkpoints (titan_exp.checkpoint), when enabled
    <run dir>/export/model.safetensors   the final model alone (checkpoint.export_format)
    <run dir>/eval/step-N/     the model at step N for lm-eval, and its results.json (titan_exp.eval)

A sweep dir (`python launch.py -m`) holds one run dir per member, each with Hydra's
`.hydra/overrides.yaml`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from titan_exp.config import JobConfig, choices, problem
from titan_exp.files import atomic_write

# pending: submitted to SLURM, not started; running: started (or requeued); interrupted: stopped
# by a signal at a step boundary (resumable); cancelled: the SLURM job was cancelled.
Status = choices("Status", "ok failed oom invalid running pending interrupted cancelled")
FINAL = (Status.ok, Status.failed, Status.oom, Status.invalid, Status.cancelled)  # nothing later changes these


@dataclass
class LayoutSpan:
    """One layout of an elastic run (cluster.elastic): the world it ran on, its degrees
    (RunSummary.layout's), and the checkpoint step it continued from (0: the start)."""

    from_step: int
    world: int
    layout: dict[str, int]


@dataclass
class RunSummary:
    """summary.json. Fields that do not apply to a run (no steps trained, not on SLURM, ...) are
    None and left out of the file."""

    status: Status
    run_dir: str = ""
    # What the run was (RunSummary.of).
    model: Optional[str] = None
    precision: Optional[str] = None
    world_size: Optional[int] = None
    layout: Optional[dict[str, int]] = None
    compile: Optional[bool] = None
    activation_checkpoint: Optional[str] = None
    global_batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    slurm_job_id: Optional[str] = None
    layouts: Optional[list[LayoutSpan]] = None  # cluster.elastic: every layout the run used, oldest first
    # Why it did not finish.
    error: Optional[str] = None
    errors: Optional[list[str]] = None  # every validation error of an invalid run
    rank_failures: Optional[str] = None  # what the executor saw of each failed rank
    hung_ranks: Optional[list[int]] = None
    slurm_state: Optional[str] = None
    interrupted_by: Optional[list[str]] = None
    interrupted_at_step: Optional[int] = None
    checkpoint_at_stop: Optional[bool] = None  # whether a checkpoint was written when it stopped
    # What it did.
    start_step: Optional[int] = None
    steps: Optional[int] = None
    final_loss: Optional[float] = None
    losses: Optional[list[float]] = None
    final_val_loss: Optional[float] = None  # validation.enable: the held-out loss at the last validation
    val_losses: Optional[dict[str, float]] = None  # step (as JSON spells it) -> held-out loss
    # data.mixture: each source's held-out loss at the last validation
    val_loss_per_source: Optional[dict[str, float]] = None
    tokens_per_source: Optional[dict[str, int]] = None  # data.mixture: tokens trained on from each source
    grad_norms: Optional[list[float]] = None
    # eval.enable: the last step's evaluation ({task: {metric: value}}; the earlier ones are in
    # metrics.jsonl), the evaluations that failed (step -> why; training went on) or were skipped
    eval: Optional[dict[str, dict[str, float]]] = None
    eval_errors: Optional[dict[str, str]] = None
    eval_skipped_steps: Optional[list[int]] = None
    # MoE: the last step's max/min tokens per expert over the mean, largest bias
    expert_load: Optional[dict[str, float]] = None
    skipped_steps: Optional[list[int]] = None
    # Steady state: the steps after this segment's first metrics.warmup_steps (all of them in a run
    # too short to have any). tokens/s and MFU of the median steady step, which one slow step does
    # not move; the _mean fields are all steady tokens over all steady time.
    tokens_per_second_per_device: Optional[float] = None
    mfu: Optional[float] = None
    tokens_per_second_per_device_mean: Optional[float] = None
    mfu_mean: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    peak_memory_allocated_gib: Optional[float] = None  # GPU: the most tensors held (peak_memory_gib is reserved)
    state_bytes_per_rank: Optional[int] = None
    dry_run: Optional[dict[str, Any]] = None  # cluster.dry_run: the rank's bytes and memory beside the planner's
    train_time_s: Optional[float] = None
    wall_time_s: Optional[float] = None
    num_params: Optional[int] = None
    flops_per_token: Optional[int] = None
    peak_tflops: Optional[float] = None
    peak_tflops_source: Optional[str] = None
    first_step_s: Optional[float] = None
    step_times_s: Optional[list[float]] = None  # every step this run trained, warm-up included
    compile_s: Optional[float] = None
    compile_cache: Optional[str] = None  # warm: every inductor graph came from the cache; cold: none did;
    # partial; none: nothing went through inductor's cache (another compile backend)
    compile_cache_dir: Optional[str] = None
    compile_cache_tag: Optional[str] = None  # this config's key in it (parallel/compile.py)
    fx_graph_cache_hits: Optional[int] = None
    fx_graph_cache_misses: Optional[int] = None
    checkpoint_blocking_s: Optional[float] = None
    export: Optional[str] = None
    seed_checkpoint: Optional[str] = None
    machine_profile: Optional[str] = None  # a calibration job's output (titan_exp.perf.calibrate)

    @classmethod
    def of(cls, job: JobConfig, status: Status, run_dir: str | os.PathLike, **fields: Any) -> "RunSummary":
        """A summary of `job` that says what the run was, for the report to compare runs by."""
        return cls(
            status=status,
            run_dir=str(run_dir),
            model=job.model.flavor,
            precision=job.precision.name,
            world_size=job.world_size,
            layout=job.parallelism.layout,
            compile=job.compile.enable,
            activation_checkpoint=job.activation_checkpoint.mode.value,
            global_batch_size=job.training.global_batch_size,
            seq_len=job.training.seq_len,
            **fields,
        )

    def replace(self, **fields: Any) -> "RunSummary":
        return dataclasses.replace(self, **fields)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSummary":
        known = {f.name for f in dataclasses.fields(cls)}
        typed = {"status": Status(data["status"])} | (
            {"layouts": [LayoutSpan(**span) for span in data["layouts"]]} if data.get("layouts") else {})
        return cls(**{k: v for k, v in data.items() if k in known} | typed)


EVAL_OBJECTIVE = "eval.<task>.<metric>"  # an evaluation's number (summary.json's eval), e.g. eval.hellaswag.acc_norm


def objectives() -> list[str]:
    """The summary's numbers a sweep may optimise (`sweep.objective`), besides EVAL_OBJECTIVE."""
    import typing

    hints = typing.get_type_hints(RunSummary)
    return [f.name for f in dataclasses.fields(RunSummary)
            if hints[f.name] in (Optional[float], Optional[int]) and not f.name.startswith("eval")]


def eval_objective(name: str) -> tuple[str, str]:
    """(task, metric) of an `eval.<task>.<metric>` name (a task name may hold dots, a metric not)."""
    task, _, metric = name.removeprefix("eval.").rpartition(".")
    return task, metric


def eval_objective_errors(job: JobConfig, objective: str) -> list[str]:
    """`eval.<task>.<metric>` names a task of eval.tasks, with eval on (the metric is the task's own)."""
    task, metric = eval_objective(objective)
    if not job.eval.enable:
        return [problem("sweep.objective", objective, "an evaluation's number needs eval.enable=true and the task "
                        "in eval.tasks")]
    if not task or not metric or task not in job.eval.tasks:
        example = f"eval.{(job.eval.tasks or ['hellaswag'])[0]}.acc"
        return [problem("sweep.objective", objective, f"not {EVAL_OBJECTIVE} with a task of eval.tasks "
                        f"({', '.join(job.eval.tasks)}), e.g. {example}")]
    return []


def check(job: JobConfig, cuda: bool) -> list[str]:
    objective = job.sweep.objective
    if objective is not None and objective.startswith("eval."):
        return eval_objective_errors(job, objective)
    if objective is not None and objective not in objectives():
        import difflib

        close = difflib.get_close_matches(objective, objectives(), n=2)
        hint = (f"did you mean {' or '.join(close)}?" if close
                else f"choose from {', '.join(objectives())}, {EVAL_OBJECTIVE}")
        return [problem("sweep.objective", objective, f"not a number summary.json records; {hint}")]
    return []


def objective_value(summary: RunSummary | None, name: str) -> float:
    """What a member returns to an optimising sweeper: the summary's number, NaN if it has none
    (the run failed, or was invalid), which Optuna records as a failed trial."""
    value = getattr(summary, name, None) if summary is not None and summary.status == Status.ok else None
    if name.startswith("eval.") and summary is not None and summary.status == Status.ok:
        task, metric = eval_objective(name)
        value = (summary.eval or {}).get(task, {}).get(metric)
    return float("nan") if value is None else float(value)


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    config = property(lambda self: self.path / "config.yaml")
    tokenizer = property(lambda self: self.path / "tokenizer.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    logs = property(lambda self: self.path / "logs")
    slurm_job = property(lambda self: self.path / "slurm_job.json")
    layouts = property(lambda self: self.path / "layouts.json")
    overrides = property(lambda self: self.path / ".hydra" / "overrides.yaml")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def write_summary(self, summary: RunSummary) -> None:
        """Atomic, so a reader never sees half a summary."""
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(self.summary, json.dumps(summary.to_dict(), indent=2, default=str))

    def read_summary(self) -> RunSummary | None:
        try:
            return RunSummary.from_dict(json.loads(self.summary.read_text()))
        except FileNotFoundError:
            return None

    def read_layouts(self) -> list[LayoutSpan]:
        """cluster.elastic: the layouts the run has used so far (none recorded: [])."""
        if not self.layouts.exists():
            return []
        return [LayoutSpan(**span) for span in json.loads(self.layouts.read_text())]

    def write_layouts(self, spans: list[LayoutSpan]) -> None:
        atomic_write(self.layouts, json.dumps([dataclasses.asdict(s) for s in spans], indent=1))

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line]


def sweep_members(sweep: Path) -> list[RunDir]:
    """The member run dirs of a sweep dir: the subdirectories Hydra gave a job number, in order."""
    found = (RunDir(d) for d in Path(sweep).iterdir() if (d / ".hydra" / "overrides.yaml").exists())
    return sorted(found, key=lambda r: (not r.path.name.isdigit(),
                                        int(r.path.name) if r.path.name.isdigit() else r.path.name))


__all__ = ["FINAL", "LayoutSpan", "RunDir", "RunSummary", "Status", "check", "objective_value", "objectives",
           "sweep_members"]
