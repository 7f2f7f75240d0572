"""The trainer's side of evaluation: at each evaluation step every rank writes the model (a
model-only DCP checkpoint, so every layout works: FSDP shards, TP, pipeline stages), and rank 0
starts the evaluator on it (`python -m titan_exp.eval`, a process of its own, Hugging Face
offline) and goes on training. Rank 0 polls it after every step (without waiting) and sends
its results to every sink when it is done.

One evaluation runs at a time: at an eval.freq step while the previous one is still running,
that step's evaluation is skipped (logged, and listed in summary.json's eval_skipped_steps),
so training never waits for one. The last step's evaluation always runs (summary.json's eval):
its model is written at once and it starts when the previous one ends; the run awaits it, every rank
polling rank 0's evaluator each second (so no collective waits longer). A failed evaluation is
logged with the end of its output and recorded in summary.json (eval_errors); training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from titan_exp.checkpoint.manager import Checkpointer
from titan_exp.checkpoint.states import ModelState
from titan_exp.checkpoint.store import step_dir
from titan_exp.config import AsyncMode, JobConfig
from titan_exp.eval.evaluator import LOG, RESULTS
from titan_exp.record import RunDir

logger = logging.getLogger("titan_exp.eval")

# The Hugging Face libraries read only what is on this machine (local task files, the HF cache).
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# torch elastic's variables: left in, they would make the evaluator's accelerate join this job.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TAIL_CHARS = 2000

Results = dict[str, dict[str, float]]  # task -> metric -> value


@dataclass
class Running:
    step: int
    process: subprocess.Popen
    folder: Path


def evaluator_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES and not k.startswith("TORCHELASTIC_")}
    return env | OFFLINE


def tail(path: Path, chars: int = TAIL_CHARS) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


class Evaluations:
    """eval.* during training; with eval.enable=false every method does nothing. Every rank
    calls `after_step` after each step and `finish` after the last; the evaluator and the results
    are rank 0's."""

    def __init__(self, job: JobConfig, run_dir: RunDir, device: torch.device, model_parts: list[torch.nn.Module],
                 log_results: Callable[[int, Results], None]):
        self.ev, self.run_dir, self.log_results = job.eval, run_dir, log_results
        self.enabled = job.eval.enable
        self.rank = dist.get_rank()
        self.device = job.eval.device or str(device)
        self.running: Running | None = None
        self.queued: int | None = None  # the last step's evaluation, written, waiting for the previous one
        self.results: dict[int, Results] = {}
        self.errors: dict[str, str] = {}  # step (as JSON spells it) -> why it failed
        self.skipped: list[int] = []
        if not self.enabled:
            return
        if self.rank == 0:  # copies an earlier segment of this run left unexported (its evaluator was stopped)
            shutil.rmtree(self.root / "checkpoints", ignore_errors=True)
        # The model at an evaluation step: model only, in checkpoint.export_dtype, every rank its shards.
        snapshots = dataclasses.replace(job.checkpoint, enable=True, folder=str(self.root / "checkpoints"),
                                        async_mode=AsyncMode.disabled, keep_latest_k=0)
        self.snapshots = Checkpointer(snapshots, run_dir.path, {"model": ModelState(model_parts)})

    @property
    def root(self) -> Path:
        return self.run_dir.path / "eval"

    def due(self, step: int, last_step: int) -> bool:
        return self.enabled and (step % self.ev.freq == 0 or step == last_step)

    def after_step(self, step: int, last_step: int) -> None:
        """Collect a finished evaluation (rank 0, without waiting); at an evaluation step write
        the model and start (or queue) its evaluation, or skip it while one is running."""
        if not self.enabled:
            return
        self._collect()
        if not self.due(step, last_step):
            return
        busy = [self.running is not None]
        dist.broadcast_object_list(busy, src=0)  # every rank saves, or none does
        if busy[0] and step != last_step:
            self.skipped.append(step)
            if self.rank == 0:
                logger.warning("step %d: evaluation skipped, step %d's is still running (eval.freq=%d)",
                               step, self.running.step, self.ev.freq)
            return
        self.snapshots.save(step, model_only=True)
        if self.rank == 0:
            self.queued = step
            self._collect()  # starts it unless the previous one is still running

    def finish(self, last_step: int, interrupted: bool) -> dict[str, Any]:
        """Await the evaluation still running or queued (every rank polls rank 0 each second),
        or, for a run stopped by a signal, end it; the summary's eval fields (rank 0's): `eval` is
        the last step's evaluation (the model the run ends with), absent when it failed."""
        if not self.enabled:
            return {}
        if interrupted:
            self.kill()
        while True:
            self._collect()
            done = [self.running is None and self.queued is None]
            dist.broadcast_object_list(done, src=0)
            if done[0]:
                break
            time.sleep(1.0)
        fields: dict[str, Any] = {}
        if last_step in self.results:
            fields["eval"] = self.results[last_step]
        if self.errors:
            fields["eval_errors"] = self.errors
        if self.skipped:
            fields["eval_skipped_steps"] = self.skipped
        return fields

    def kill(self) -> None:
        """End the evaluator this rank started, if one is running (a run that stops or fails)."""
        self.queued = None
        if self.running is not None:
            self.running.process.kill()
            self.running.process.wait()
            logger.warning("step %d's evaluation was stopped with the run", self.running.step)
            self.running = None

    def _collect(self) -> None:
        """Rank 0: read the evaluation that ended, if one did; then start the queued one."""
        if self.rank != 0:
            return
        if self.running is not None and self.running.process.poll() is not None:
            self._ended(self.running)
            self.running = None
        if self.running is None and self.queued is not None:
            self.running = self._start(self.queued)
            self.queued = None

    def _start(self, step: int) -> Running:
        folder = step_dir(self.root, step)  # the evaluator writes it (the export replaces it whole)
        command = [sys.executable, "-m", "titan_exp.eval", str(folder), "--tasks", *self.ev.tasks,
                   "--batch-size", str(self.ev.batch_size), "--device", self.device,
                   "--export", str(step_dir(self.root / "checkpoints", step)), "--run-dir", str(self.run_dir.path),
                   "--out", str(self.root / f".results-{step}.json")]
        if self.ev.include_path is not None:
            command += ["--include-path", self.ev.include_path]
        if self.ev.limit is not None:
            command += ["--limit", str(self.ev.limit)]
        with open(self.root / f"step-{step}.log", "w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=evaluator_env(), cwd=self.run_dir.path)
        logger.info("step %d: evaluating %s in process %d (%s)", step, ", ".join(self.ev.tasks), process.pid, folder)
        return Running(step, process, folder)

    def _ended(self, run: Running) -> None:
        import json

        log, out = self.root / f"step-{run.step}.log", self.root / f".results-{run.step}.json"
        code = run.process.returncode
        if code == 0 and out.is_file():
            results = json.loads(out.read_text())
            out.replace(run.folder / RESULTS)
            log.replace(run.folder / LOG)
            self.results[run.step] = results["eval"]
            self.log_results(run.step, results["eval"])
            return
        self.errors[str(run.step)] = f"the evaluator exited with {code}; its output ends: {tail(log)}"
        logger.error("step %d: evaluation failed (exit %s); training goes on. Its output (%s) ends:\n%s",
                     run.step, code, log, tail(log))
