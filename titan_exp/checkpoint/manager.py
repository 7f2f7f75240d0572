"""Checkpointing during training: what a run starts from (`load_source`), what the launcher can
check before any process starts (`preflight`, `check`), and the Checkpointer that saves every
`interval` steps and restores a run from its folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from titan_exp import faults
from titan_exp.checkpoint.states import PARTS, Stateful, flat_shapes
from titan_exp.checkpoint.store import (
    EXPORT_DTYPES,
    MARKER,
    CheckpointError,
    SafePlanner,
    SafeReader,
    checkpoint_folder,
    complete_steps,
    crc32,
    describe_mismatch,
    incomplete_dirs,
    not_a_checkpoint,
    optimizer_mismatch,
    optimizer_states,
    read_marker,
    read_metadata,
    shape_errors,
    step_dir,
    verify,
)
from titan_exp.config import AsyncMode, CheckpointConfig, JobConfig, ModelConfig, SaveReplicas, problem
from titan_exp.files import atomic_write, unwritable
from titan_exp.models import hf

logger = logging.getLogger("titan_exp.checkpoint")


def check(job: JobConfig, cuda: bool) -> list[str]:
    """Static rules; `preflight` checks the folder and the checkpoint a run would load."""
    e: list[str] = []
    k = job.checkpoint
    if k.interval < 1:
        e.append(problem("checkpoint.interval", k.interval, "must be >= 1"))
    if k.keep_latest_k < 0:
        e.append(problem("checkpoint.keep_latest_k", k.keep_latest_k, "must be >= 0 (0 keeps every checkpoint)"))
    if k.load_step < -1:
        e.append(problem("checkpoint.load_step", k.load_step, "must be a saved step, or -1 for the latest"))
    if k.async_mode == AsyncMode.async_with_pinned_mem and not cuda:
        e.append(problem("checkpoint.async_mode", k.async_mode, "pinned memory needs CUDA; use async on this machine"))
    if not k.folder:
        e.append(problem("checkpoint.folder", k.folder, "give a folder (relative paths are inside the run dir)"))
    if not k.enable:
        needs = {"export_format": k.export_format is not None, "create_seed_checkpoint": k.create_seed_checkpoint,
                 "last_save_model_only": k.last_save_model_only, "initial_load_path": k.initial_load_path is not None,
                 "last_save_in_hf": k.last_save_in_hf}
        for name, used in needs.items():
            if used:
                e.append(problem(f"checkpoint.{name}", getattr(k, name),
                                 "needs checkpoint.enable=true (or checkpoint=default)"))
    if k.initial_load_in_hf and not k.initial_load_path:
        e.append(problem("checkpoint.initial_load_in_hf", True,
                         "needs checkpoint.initial_load_path=<a Hugging Face model directory>"))
    elif k.initial_load_in_hf and not k.initial_load_model_only:
        e.append(problem("checkpoint.initial_load_model_only", False,
                         "a Hugging Face directory holds weights only; set it to true (the default)"))
    return e


def load_source(cfg: CheckpointConfig, folder: Path) -> tuple[Path | None, tuple[str, ...]]:
    """(checkpoint dir, parts to restore) a run starts from; (None, ()) to start fresh.

    The run's own folder comes first: `load_step`, or the newest complete checkpoint with the
    full training state. A model-only one (a seed checkpoint) gives the initial weights when no
    full one exists. Failing those, `initial_load_path`. Raises CheckpointError if `load_step`
    names a checkpoint that is not there."""
    steps = complete_steps(folder)
    if cfg.load_step >= 0:
        if cfg.load_step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise CheckpointError(
                f"checkpoint.load_step = {cfg.load_step}: no complete checkpoint step-{cfg.load_step} in {folder} "
                f"(complete steps: {have}); pick one of those, or -1 for the latest")
        chosen = cfg.load_step
    else:
        full = [s for s, m in steps.items() if not m["model_only"]]
        chosen = full[-1] if full else (max(steps) if steps else None)
    if chosen is not None:
        parts = ("model",) if steps[chosen]["model_only"] else PARTS
        return step_dir(folder, chosen), tuple(p for p in parts if p not in cfg.exclude_from_loading)
    if cfg.initial_load_path:
        path = Path(cfg.initial_load_path).expanduser()
        marker = read_marker(path)
        model_only = cfg.initial_load_model_only or (marker is not None and marker["model_only"])
        parts = ("model",) if model_only else PARTS
        return path, tuple(p for p in parts if p not in cfg.exclude_from_loading)
    return None, ()


def from_hf(cfg: CheckpointConfig, path: Path) -> bool:
    """Whether the run starts from `path` as a Hugging Face directory (checkpoint.initial_load_in_hf)."""
    return (cfg.initial_load_in_hf and cfg.initial_load_path is not None
            and path == Path(cfg.initial_load_path).expanduser())


def preflight(cfg: CheckpointConfig, run_dir: Path, model_shapes: dict[str, torch.Size],
              model_cfg: ModelConfig, optimizer_state: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """What the launcher can know before starting a process: the folder is writable, the
    checkpoint the run would load exists, is whole and fits the model, and its optimizer state
    fits this run's optimizer (`optimizer_state`: each parameter's state names; None = not known)."""
    if not cfg.enable:
        return []
    errors = []
    folder = checkpoint_folder(cfg, run_dir)
    if (problem := unwritable(folder)) is not None:
        errors.append(f"checkpoint.folder = {cfg.folder}: cannot write to {folder} ({problem}); "
                      "choose a writable folder")
    try:
        path, parts = load_source(cfg, folder)
    except CheckpointError as exc:
        return errors + [str(exc)]
    if path is None:
        return errors
    field = ("checkpoint.initial_load_path"
             if cfg.initial_load_path and path == Path(cfg.initial_load_path).expanduser() else "checkpoint.folder")
    if field == "checkpoint.initial_load_path" and (why := not_a_checkpoint(path, hf=from_hf(cfg, path))):
        return errors + [f"{field} = {cfg.initial_load_path!r}: {why}"]
    if from_hf(cfg, path):
        try:
            wrong = hf.shape_errors(path, model_cfg, model_shapes)
        except (OSError, ValueError) as exc:
            return errors + [f"{field} = {str(path)!r}: not a Hugging Face model directory ({exc})"]
        return errors + [f"{field}: {w}; the model's shapes must match "
                         f"(model.hf_config={path} takes them from its config.json)"
                         for w in wrong[:5]]
    if (problem := verify(path)) is not None:
        return errors + [f"{field}: {problem}; delete that step dir or choose another checkpoint"]
    model = {f"model.{k}": v for k, v in model_shapes.items()}
    saved = read_metadata(path).state_dict_metadata
    if "model" in parts and (wrong := shape_errors(saved, model, ("model",))):
        errors.append(f"{field}: {describe_mismatch(path, wrong)}")
    if "optimizer" in parts and optimizer_state and (why := optimizer_mismatch(path, saved, optimizer_state)):
        errors.append(f"{field}: {why}")
    return errors


class Checkpointer:
    """Saves every `interval` steps and at the last step, and restores a run from its folder.
    With `enable=false` every method does nothing, so the training loop reads the same either way."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, states: dict[str, Stateful], *,
                 replica_ranks: list[int] | None = None, model: ModelConfig | None = None):
        """`replica_ranks`: the global ranks of the first data-parallel replica (HSDP/DDP), for
        `hsdp_save_replicas=first`; None when there is one replica. `model`: the shapes, for a
        Hugging Face initial load."""
        self.cfg, self.states, self.model = cfg, states, model
        self.folder = checkpoint_folder(cfg, run_dir)
        self.rank = dist.get_rank()
        self.pending: tuple[int, Future] | None = None  # an async save in flight: step, its future
        self.blocking_s = 0.0  # time training waited for checkpoints: the cost async saving cuts
        if not cfg.enable:
            return
        if cfg.async_mode != AsyncMode.disabled:  # marks async saves complete in the background
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-finish")
        # Which ranks write, and over which group they agree on the plan: every rank (DCP
        # de-duplicates replicated shards between replicas), or only the first replica, whose
        # shards already cover every tensor. An async save runs its collectives in a background
        # thread, so it gets its own group to keep them apart from training's.
        ranks = replica_ranks if cfg.hsdp_save_replicas == SaveReplicas.first and replica_ranks else None
        self.writes = ranks is None or self.rank in ranks
        self.group = None
        if ranks is not None or cfg.async_mode != AsyncMode.disabled:
            self.group = dist.new_group(ranks=ranks, backend="gloo")
        if self.rank == 0:
            for stale in incomplete_dirs(self.folder):
                logger.warning("removing %s: a save that never finished (no %s)", stale, MARKER)
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    # Loading.

    def load(self) -> int:
        """Restore the training state of the checkpoint this run starts from (see load_source);
        returns the step it holds, 0 for a fresh run or initial weights only."""
        if not self.cfg.enable:
            return 0
        path, parts = load_source(self.cfg, self.folder)
        if path is None:
            return 0
        if from_hf(self.cfg, path):
            start = time.perf_counter()
            hf.load_into(self.states["model"].parts, path, self.model)
            logger.info("loaded the Hugging Face model %s in %.2f s", path, time.perf_counter() - start)
            return 0
        error = verify(path) if self.rank == 0 else None
        errors = [error]
        dist.broadcast_object_list(errors, src=0)
        if errors[0] is not None:
            raise CheckpointError(f"cannot resume: {errors[0]}; delete that step dir or set checkpoint.load_step")
        state = {name: self.states[name].state_dict() for name in parts}
        saved = read_metadata(path).state_dict_metadata
        if "rng" in state:  # a checkpoint from a machine without CUDA has no CUDA state, and vice versa
            state["rng"] = {k: v for k, v in state["rng"].items() if f"rng.{k}" in saved}
        if "optimizer" in parts and (why := optimizer_mismatch(path, saved, optimizer_states(
                f"optimizer.{k}" for k in flat_shapes(state["optimizer"])))):
            raise CheckpointError(why)
        if wrong := shape_errors(saved, flat_shapes(state), parts):
            raise CheckpointError(describe_mismatch(path, wrong))
        start = time.perf_counter()
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
        for name in parts:
            self.states[name].load_state_dict(state[name])
        step = self.states["train_state"].step if "train_state" in parts else 0
        logger.info("loaded %s (%s) in %.2f s; training continues after step %d",
                    path, ", ".join(parts), time.perf_counter() - start, step)
        return step

    # Saving.

    def due(self, step: int, last_step: int, *, force: bool = False) -> bool:
        """Whether `maybe_save` saves at this step: every interval and the last step, or now (`force`)."""
        return self.cfg.enable and (force or step % self.cfg.interval == 0 or step == last_step)

    def maybe_save(self, step: int, last_step: int, *, force: bool = False) -> None:
        """Save at every interval and the last step, or now (`force`: a run being stopped)."""
        if not self.cfg.enable:
            return
        start = time.perf_counter()
        self._poll()
        if self.due(step, last_step, force=force):
            self.save(step, model_only=step == last_step and self.cfg.last_save_model_only)
        self.blocking_s += time.perf_counter() - start

    def save_seed(self) -> Path:
        """The initial weights as step-0, model only: what `create_seed_checkpoint` writes."""
        self.save(0, model_only=True)
        self.close()
        return step_dir(self.folder, 0)

    def save(self, step: int, *, model_only: bool = False) -> None:
        self.wait()  # one save in flight at a time
        path = step_dir(self.folder, step)
        if self.rank == 0 and path.exists():  # saving the same step again (a resumed run)
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path)
        dist.barrier()
        if not self.writes:
            return
        if model_only:
            dtype = EXPORT_DTYPES[self.cfg.export_dtype]
            state = {"model": {k: v.to(dtype) for k, v in self.states["model"].state_dict().items()}}
        else:
            state = {name: s.state_dict() for name, s in self.states.items()}
        start = time.perf_counter()
        writer = FileSystemWriter(path)
        if self.cfg.async_mode == AsyncMode.disabled:
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                raise CheckpointError(self._failed(step, exc)) from exc
            faults.inject("save", step)
            self._finish(step, path, model_only, time.perf_counter() - start)
            return
        stager = None
        if self.cfg.async_mode == AsyncMode.async_with_pinned_mem:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
        written = dcp.async_save(state, storage_writer=writer, process_group=self.group, async_stager=stager)
        logger.info("checkpoint step-%d: staged in %.2f s, writing in the background", step,
                    time.perf_counter() - start)
        # Marking it complete (checksums, complete.json, purge) happens in the background too.
        finished = self._finisher.submit(self._finish_when_written, written, step, path, model_only, start)
        faults.inject("save", step)
        self.pending = (step, finished)

    def _finish_when_written(self, written: Future, step: int, path: Path, model_only: bool, start: float) -> None:
        written.result()
        self._finish(step, path, model_only, time.perf_counter() - start)

    def _poll(self) -> None:
        if self.pending is not None and self.pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and marked complete."""
        if self.pending is None:
            return
        step, finished = self.pending
        self.pending = None
        try:
            finished.result()
        except (Exception, CheckpointException) as exc:
            raise CheckpointError(self._failed(step, exc)) from exc

    def close(self) -> None:
        if not self.cfg.enable:
            return
        start = time.perf_counter()
        self.wait()
        if self.cfg.async_mode != AsyncMode.disabled:
            self._finisher.shutdown()
        self.blocking_s += time.perf_counter() - start

    def _failed(self, step: int, exc: BaseException) -> str:
        if isinstance(exc, CheckpointException):  # one wrapped error per failing rank
            exc = next(iter(exc.failures.values()))[0]
        latest = max(complete_steps(self.folder), default=None)
        kept = f"step-{latest} stays the latest checkpoint" if latest is not None else "there is no earlier checkpoint"
        return (f"saving checkpoint step-{step} in {self.folder} failed ({type(exc).__name__}: {exc}); {kept}. "
                "Free space or choose another checkpoint.folder")

    def _finish(self, step: int, path: Path, model_only: bool, seconds: float) -> None:
        """Rank 0, after every rank's files are written (DCP gathers every rank's result before
        its coordinator returns): record the files and mark the checkpoint complete, then purge."""
        if self.rank != 0:
            return
        files = {f.name: [f.stat().st_size, crc32(f)] for f in sorted(path.iterdir())
                 if f.is_file() and f.name != MARKER}
        marker = {"step": step, "model_only": model_only, "time": time.time(), "save_s": round(seconds, 3),
                  "files": files, "dtype": self.cfg.export_dtype.value if model_only else "as trained"}
        atomic_write(path / MARKER, json.dumps(marker, indent=1))
        size = sum(size for size, _ in files.values())
        logger.info("checkpoint step-%d complete: %d files, %.1f MiB, %.2f s", step, len(files), size / 2**20, seconds)
        self._purge()

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        steps = list(complete_steps(self.folder))
        for old in steps[:-k] if k > 0 else []:
            path = step_dir(self.folder, old)
            (path / MARKER).unlink()  # first, so a crash halfway leaves an incomplete dir, never a broken complete one
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed checkpoint step-%d (keep_latest_k=%d)", old, k)
