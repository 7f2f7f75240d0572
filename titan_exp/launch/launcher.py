"""The launcher, one way through: preflight -> run record -> executor -> outcome.

Nothing is spawned and nothing of the run is written until every preflight step passed.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

from omegaconf import DictConfig

from titan_exp.cluster import get_executor
from titan_exp.config import refusal, to_job_config, to_yaml
from titan_exp.launch.preflight import Pending, preflight
from titan_exp.models.tokenizer import TOKENIZER_CONFIG
from titan_exp.record import RunDir, RunSummary, Status
from titan_exp.signals import EXIT_INTERRUPTED

logger = logging.getLogger("titan_exp.launch")

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2  # and signals.EXIT_INTERRUPTED, 3


def launch(cfg: DictConfig, run_dir: str, *, multirun: bool = False, sweep_dir: str = "",
           overrides_name: str = "") -> int:
    """Run one job; returns an exit code. In a sweep an invalid member leaves a summary saying
    so; a single invalid run writes nothing. A sweep member (`sweep_dir`, Hydra's
    `override_dirname`) is tracked in the sweep's wandb group, named by its overrides."""
    job = to_job_config(cfg)
    if multirun and job.metrics.enable_wandb:
        from titan_exp.metrics import sweep_member_tracking

        job = sweep_member_tracking(job, sweep_dir, overrides_name)
    pending, errors = preflight(job, RunDir(run_dir))
    if errors:
        for error in errors:  # one line each; on the console, on stderr (titan_exp.cli)
            logger.error(refusal(error), extra={"refusal": True})
        if multirun:
            pending.run_dir.write_summary(RunSummary.of(pending.job, Status.invalid, run_dir, error="; ".join(errors),
                                                        errors=errors))
        return EXIT_INVALID
    write_record(pending)
    job, run = pending.job, pending.run_dir
    if job.cluster.dry_run:
        from titan_exp.cluster.dry_run import run_dry

        logger.info("run dir %s | dry run of rank %d of %d, in one process here", run.path,
                    job.cluster.dry_run_rank, job.world_size)
        return outcome(run, run_dry(job, run))
    logger.info("run dir %s | %s executor, %d rank(s)", run.path, job.cluster.executor, job.world_size)
    error = get_executor(job.cluster.executor)(job, run, in_sweep=multirun)
    return outcome(run, error)


def write_record(pending: Pending) -> None:
    """The run dir as the ranks read it: the tokenizer's copy and the resolved config pointing at it."""
    run_dir = pending.run_dir
    run_dir.path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(pending.tokenizer, run_dir.tokenizer)
    special = pending.tokenizer.parent / TOKENIZER_CONFIG  # a Hugging Face directory's BOS/EOS, kept beside it
    if special.is_file():
        shutil.copyfile(special, run_dir.path / TOKENIZER_CONFIG)
    if pending.job.cluster.elastic:  # before config.yaml is replaced: it holds the last segment's layout
        from titan_exp.cluster.elastic import record_layout

        record_layout(pending.job, run_dir)
    data = dataclasses.replace(pending.job.data, tokenizer_path=str(run_dir.tokenizer))
    run_dir.config.write_text(to_yaml(dataclasses.replace(pending.job, data=data)))


def outcome(run_dir: RunDir, error: str | None) -> int:
    """The exit code of a run the executor has finished with, after making its summary say what
    happened: a rank that died before writing one, or the rank that caused a failure."""
    summary = run_dir.read_summary()
    if summary is not None and summary.status == Status.pending:
        return EXIT_OK  # queued on SLURM; the executor said where
    if summary is None or summary.status == Status.running:
        # A rank died before it could write (killed, segfault): the launcher says so.
        summary = (summary or RunSummary(status=Status.failed, run_dir=str(run_dir.path))).replace(
            status=Status.failed, error=error or "no summary written by rank 0")
        run_dir.write_summary(summary)
    elif error and summary.status == Status.ok:
        # gloo sometimes aborts in process teardown after every rank finished; the run is fine.
        logger.warning("training finished but a rank exited badly afterwards (%s); the run is ok", error)
    if summary.status in (Status.failed, Status.oom):
        summary = explain_failure(summary, error, run_dir)
    if summary.status == Status.interrupted:
        logger.warning("run interrupted by %s after step %d; relaunch with the same run dir to resume (summary %s)",
                       " and ".join(summary.interrupted_by), summary.interrupted_at_step, run_dir.summary)
        return EXIT_INTERRUPTED
    if summary.status == Status.ok:
        if summary.dry_run is not None:
            from titan_exp.cluster.dry_run import table

            logger.info("dry run done, summary %s\n%s", run_dir.summary, table(summary.dry_run))
        elif summary.final_loss is not None:
            logger.info("done: final loss %.4f, %.1f tokens/s/device, MFU %.1f%% (median steady step), summary %s",
                        summary.final_loss, summary.tokens_per_second_per_device, summary.mfu, run_dir.summary)
        else:
            logger.info("done: no steps to train (%s), summary %s",
                        summary.seed_checkpoint or f"resumed at step {(summary.start_step or 1) - 1}", run_dir.summary)
        return EXIT_OK
    logger.error("run %s: %s (summary %s)", summary.status, summary.error, run_dir.summary)
    return EXIT_FAILED


def explain_failure(summary: RunSummary, error: str | None, run_dir: RunDir) -> RunSummary:
    """Which rank failed and why. Rank 0 writes the summary, so its error is often only the
    consequence (a connection reset, a collective timeout); the cause is a rank killed by a signal
    (executor's report, listed first) or a rank that hung (its step watchdog fired)."""
    from titan_exp.watchdog import hung_ranks

    rank0 = summary.error
    if error and error != rank0:
        summary = summary.replace(rank_failures=error)
        cause = error.split("; ")[0]
        if " was killed by " in cause and not cause.endswith("SIGTERM"):
            summary = summary.replace(error=f"{cause}; rank 0 then: {rank0}")
    hung = hung_ranks(run_dir.logs)
    if hung:
        logs = ", ".join(str(run_dir.rank_log(k)) for k in hung)
        summary = summary.replace(
            hung_ranks=hung,
            error=f"rank(s) {', '.join(map(str, hung))} hung (their step watchdog fired; stacks in {logs}); "
                  f"rank 0 then: {rank0}")
    run_dir.write_summary(summary)
    return summary
