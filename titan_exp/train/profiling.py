"""Profiles that say where a step's time and memory go (`profiling.*`, TorchTitan's names).

- Traces: with `profiling.enable_profiling`, torch.profiler records one step in every
  `profile_freq` (after one warm-up step) on every rank, and writes
  `<run dir>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json` (Perfetto or
  chrome://tracing opens it). The trainer labels its phases (`forward_backward`, `optimizer`),
  so the trace and titan_exp.train.trace can split a step.
- Memory: with `profiling.enable_memory_snapshot`, a CUDA rank records the allocator's history and
  dumps `<save_memory_snapshot_folder>/rank<r>_memory_snapshot.pickle` at the end (open it at
  pytorch.org/memory_viz); a CPU rank has no allocator history, so it writes
  `rank<r>_memory_phases.json` instead: after each phase of each step, the resident set then and
  the peak resident set so far.
- Build: `timed` logs each part of building a rank (the model on the meta device, parallelizing,
  the weights) with its seconds as that part ends, so a build that takes minutes reports as it goes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import time
from pathlib import Path
from typing import Iterator

import torch

from titan_exp.config import JobConfig, problem
from titan_exp.files import atomic_write

logger = logging.getLogger("titan_exp")


def check(job: JobConfig, cuda: bool) -> list[str]:
    """The output folders are names inside the run dir."""
    e = []
    for name in ("save_traces_folder", "save_memory_snapshot_folder"):
        folder = getattr(job.profiling, name)
        if not folder or Path(folder).is_absolute() or ".." in Path(folder).parts:
            e.append(problem(f"profiling.{name}", folder, "a folder name inside the run dir, e.g. profile_traces"))
    return e


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    """Log `what` and the seconds it took, when it ends (a log line is flushed as it is written)."""
    start = time.perf_counter()
    yield
    logger.info("%s: %.1f s", what, time.perf_counter() - start)


class Profiler:
    def __init__(self, job: JobConfig, run_dir: Path, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = job.profiling, rank, device
        self.traces = run_dir / self.cfg.save_traces_folder
        self.snapshots = run_dir / self.cfg.save_memory_snapshot_folder
        self.step_num = 0
        self.prof: torch.profiler.profile | None = None
        self.phases: list[dict] = []
        self.cuda_memory = self.cfg.enable_memory_snapshot and device.type == "cuda"
        self.cpu_memory = self.cfg.enable_memory_snapshot and device.type != "cuda"

    def __enter__(self) -> "Profiler":
        if self.cfg.enable_profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            freq = self.cfg.profile_freq
            self.prof = torch.profiler.profile(
                activities=activities, schedule=torch.profiler.schedule(wait=freq - 2, warmup=1, active=1),
                on_trace_ready=self._save_trace)
            self.prof.start()
        if self.cuda_memory:
            # Python frames only: symbolizing C++ frames at the dump takes minutes on a large model
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        return self

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        out = self.traces / f"iteration_{self.step_num}" / f"rank{self.rank}_trace.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out))
        logger.info("profiler trace of step %d: %s", self.step_num, out)

    def step(self, step: int) -> None:
        """After each training step."""
        self.step_num = step
        if self.prof is not None:
            self.prof.step()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A labelled part of a step: a range in the trace, a memory record on CPU."""
        with torch.profiler.record_function(name):
            yield
        if self.cpu_memory:
            self.phases.append({"step": self.step_num + 1, "phase": name, "rss_gib": round(_rss_gib(), 4),
                                "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 4)})

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.prof.stop()
        if self.cuda_memory:
            self.snapshots.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.snapshots / f"rank{self.rank}_memory_snapshot.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.cpu_memory and self.phases:
            self.snapshots.mkdir(parents=True, exist_ok=True)
            atomic_write(self.snapshots / f"rank{self.rank}_memory_phases.json", json.dumps(self.phases, indent=1))
