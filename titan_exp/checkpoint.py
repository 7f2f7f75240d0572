"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

    <folder>/step-N/.metadata, __R_I.distcp   one DCP checkpoint, written by every rank
    <folder>/step-N/complete.json             written last, by rank 0, once every rank finished

A step dir without `complete.json` is an interrupted save: it is never loaded, and it is removed
when the next run starts. `complete.json` lists each file's size and CRC32, so a truncated or
corrupted shard is named before anything is read from it.

What a checkpoint holds (the top-level keys, `PARTS`): the model (FQNs of the unsplit model, so a
checkpoint loads into any layout: FSDP N, TP, PP, one process), the optimizer (flattened per
parameter FQN), the lr scheduler, the data position, the RNG state, and the step and tokens
seen. A model-only checkpoint (`create_seed_checkpoint`, `last_save_model_only`) holds the model
alone, in `export_dtype`.

The data position is the same on every rank: every data-parallel rank reads the one token stream
and keeps its slice of each global batch (see `titan_exp.data.loader`). So resuming under another
data-parallel degree continues the stream exactly where it stopped, with no skipped or repeated
data; only the slicing of each later batch changes.

Loading never unpickles arbitrary objects: DCP's `.metadata` is read with an unpickler that
admits only DCP's own metadata classes, and the few non-tensor values (scheduler and optimizer
hyperparameters, the data position) load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import pickle
import re
import shutil
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from titan_exp.cache import atomic_write, unwritable
from titan_exp.config import CheckpointConfig
from titan_exp.faults import maybe_fault

logger = logging.getLogger("titan_exp.checkpoint")

MARKER = "complete.json"
PARTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXPORT_FORMATS = {"safetensors": "model.safetensors", "pt": "model.pt"}
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    pass


# --- The folder: which checkpoints exist, and are they whole -------------------------------------


def checkpoint_folder(cfg: CheckpointConfig, run_dir: Path) -> Path:
    folder = Path(cfg.folder).expanduser()
    return folder if folder.is_absolute() else Path(run_dir) / folder


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step-{step}"


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def complete_steps(folder: Path) -> dict[int, dict[str, Any]]:
    """Step -> marker of every complete checkpoint in `folder`, oldest first."""
    found = {}
    if folder.is_dir():
        for child in folder.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (marker := read_marker(child)) is not None:
                found[int(match.group(1))] = marker
    return dict(sorted(found.items()))


def incomplete_dirs(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return [c for c in folder.iterdir() if _STEP_DIR.match(c.name) and read_marker(c) is None]


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify(path: Path) -> str | None:
    """None if every file `complete.json` lists is there with its size and checksum, else why not."""
    marker = read_marker(path)
    if marker is None:
        return f"{path} is not a complete checkpoint (no {MARKER}: the save never finished)"
    for name, (size, crc) in marker["files"].items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != size:
            return f"{file} is truncated or overwritten: {file.stat().st_size} bytes, {size} when saved"
        if _crc32(file) != crc:
            return f"{file} is corrupted: its checksum differs from the one recorded when it was saved"
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; admit exactly the classes DCP puts there (plain data types
    whose construction runs no code of the file's choosing), refuse anything else."""

    ALLOWED = {
        *(("torch.distributed.checkpoint.metadata", n) for n in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "ChunkStorageMetadata",
            "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # a layout by name (torch.strided)
        ("torch", "Size"),
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint never holds")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        with open(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{self.path}/.metadata does not hold DCP metadata")
        return metadata


class SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        raw = value.read()
        torch.load(io.BytesIO(raw), weights_only=True)  # refuses anything but plain data
        super().load_bytes(read_item, io.BytesIO(raw))


def read_metadata(path: Path) -> Metadata:
    return SafeReader(path).read_metadata()


def shape_errors(saved: dict[str, Any], expected: dict[str, torch.Size], parts: tuple[str, ...]) -> list[str]:
    """How the tensors `expected` (flattened key -> global shape) differ from those a checkpoint
    holds (`saved`: its metadata's state_dict_metadata), for keys under `parts`."""
    wrong = []
    for key, shape in expected.items():
        if key.split(".", 1)[0] not in parts:
            continue
        meta = saved.get(key)
        if meta is None:
            wrong.append(f"{key} is not in it")
        elif isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(shape):
            wrong.append(f"{key} is {list(meta.size)} there, {list(shape)} here")
    return wrong


def describe_mismatch(path: Path, wrong: list[str]) -> str:
    more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
    return (f"checkpoint {path} does not fit this model: {'; '.join(wrong[:3])}{more}. It was saved from a "
            "different model shape: use a checkpoint of this model, or another run dir / checkpoint.folder")


# --- What a run loads ----------------------------------------------------------------------------


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


def preflight(cfg: CheckpointConfig, run_dir: Path, model_shapes: dict[str, torch.Size]) -> list[str]:
    """What the launcher can know before starting a process: the folder is writable, the
    checkpoint the run would load exists, is whole and fits the model."""
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
    field = "checkpoint.initial_load_path" if cfg.initial_load_path and path == Path(cfg.initial_load_path).expanduser() else "checkpoint.folder"
    if (problem := verify(path)) is not None:
        return errors + [f"{field}: {problem}; delete that step dir or choose another checkpoint"]
    model = {f"model.{k}": v for k, v in model_shapes.items()}
    if "model" in parts and (wrong := shape_errors(read_metadata(path).state_dict_metadata, model, ("model",))):
        errors.append(f"{field}: {describe_mismatch(path, wrong)}")
    return errors


# --- The state, as DCP sees it --------------------------------------------------------------------


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelState:
    """Every model part (pipeline stages) of this rank as one state dict keyed by the FQNs of the
    unsplit model; DTensors stay sharded, DCP writes each shard once."""

    def __init__(self, parts: list[torch.nn.Module]):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.parts for k, v in get_model_state_dict(part).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, {k: state[k] for k in get_model_state_dict(part)})


class OptimizerState:
    """One optimizer per model part, flattened to `state.<fqn>.<name>` / `param_groups.<fqn>.<key>`,
    so optimizer state reshards across layouts like the parameters."""

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]):
        self.pairs = list(zip(parts, optimizers))

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part, opt in self.pairs for k, v in get_optimizer_state_dict(part, opt, options=self.OPTIONS).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, opt in self.pairs:
            mine = get_optimizer_state_dict(part, opt, options=self.OPTIONS)
            set_optimizer_state_dict(part, opt, {k: state[k] for k in mine}, options=self.OPTIONS)


class SchedulerState:
    """The schedulers step together; one state (without the lambdas, which are code) loads into all."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]):
        self.schedulers = schedulers

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.schedulers[0].state_dict().items() if k != "lr_lambdas"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict({**scheduler.state_dict(), **state})


class JSONState:
    """A stateful object whose state is plain data (the data loader), saved as one JSON string."""

    def __init__(self, obj: Stateful):
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"json": json.dumps(self.obj.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(json.loads(state["json"]))


class RNGState:
    """Every rank seeds alike and training draws no per-rank random numbers, so one state
    (identical on all ranks, written once by DCP) restores every rank."""

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class TrainState:
    def __init__(self):
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step), "tokens_seen": torch.tensor(self.tokens_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])


def flat_shapes(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Size]:
    """Global shape of every tensor in a nested state dict, under DCP's flattened keys."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat_shapes(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = v.shape
    return out


# --- Saving and loading during training -----------------------------------------------------------


class Checkpointer:
    """Saves every `interval` steps and at the last step, and restores a run from its folder.
    With `enable=false` every method does nothing, so the training loop reads the same either way."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, states: dict[str, Stateful], *,
                 replica_ranks: list[int] | None = None):
        """`replica_ranks`: the global ranks of the first data-parallel replica (HSDP/DDP), for
        `hsdp_save_replicas=first`; None when there is one replica."""
        self.cfg, self.states = cfg, states
        self.folder = checkpoint_folder(cfg, run_dir)
        self.rank = dist.get_rank()
        self.pending: tuple[int, Future] | None = None  # an async save in flight: step, its future
        self.blocking_s = 0.0  # time training waited for checkpoints: the cost async saving cuts
        if not cfg.enable:
            return
        if cfg.async_mode != "disabled":  # marks async saves complete in the background
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-finish")
        # Which ranks write, and over which group they agree on the plan: every rank (DCP
        # de-duplicates replicated shards between replicas), or only the first replica, whose
        # shards already cover every tensor. An async save runs its collectives in a background
        # thread, so it gets its own group to keep them apart from training's.
        ranks = replica_ranks if cfg.hsdp_save_replicas == "first" and replica_ranks else None
        self.writes = ranks is None or self.rank in ranks
        self.group = None
        if ranks is not None or cfg.async_mode != "disabled":
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
        error = verify(path) if self.rank == 0 else None
        errors = [error]
        dist.broadcast_object_list(errors, src=0)
        if errors[0] is not None:
            raise CheckpointError(f"cannot resume: {errors[0]}; delete that step dir or set checkpoint.load_step")
        state = {name: self.states[name].state_dict() for name in parts}
        saved = read_metadata(path).state_dict_metadata
        if "rng" in state:  # a checkpoint from a machine without CUDA has no CUDA state, and vice versa
            state["rng"] = {k: v for k, v in state["rng"].items() if f"rng.{k}" in saved}
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

    def maybe_save(self, step: int, last_step: int, *, force: bool = False) -> None:
        """Save at every interval and the last step, or now (`force`: a run being stopped)."""
        if not self.cfg.enable:
            return
        start = time.perf_counter()
        self._poll()
        if force or step % self.cfg.interval == 0 or step == last_step:
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
        if self.cfg.async_mode == "disabled":
            try:
                dcp.save(state, storage_writer=writer, process_group=self.group)
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                raise CheckpointError(self._failed(step, exc)) from exc
            maybe_fault("save", step)
            self._finish(step, path, model_only, time.perf_counter() - start)
            return
        stager = None
        if self.cfg.async_mode == "async_with_pinned_mem":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
        written = dcp.async_save(state, storage_writer=writer, process_group=self.group, async_stager=stager)
        logger.info("checkpoint step-%d: staged in %.2f s, writing in the background", step, time.perf_counter() - start)
        # Marking it complete (checksums, complete.json, purge) happens in the background too.
        finished = self._finisher.submit(self._finish_when_written, written, step, path, model_only, start)
        maybe_fault("save", step)
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
        if self.cfg.async_mode != "disabled":
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
        files = {f.name: [f.stat().st_size, _crc32(f)] for f in sorted(path.iterdir()) if f.is_file() and f.name != MARKER}
        marker = {"step": step, "model_only": model_only, "time": time.time(), "save_s": round(seconds, 3), "files": files,
                  "dtype": self.cfg.export_dtype if model_only else "as trained"}
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


# --- Export: the model alone, in one file ---------------------------------------------------------


def export(path: Path, out: Path, dtype: str = "float32", fmt: str = "safetensors") -> Path:
    """Consolidate the model of checkpoint `path` into one file (no process group needed):
    safetensors, or torch's format (a plain dict of tensors, loadable with weights_only=True)."""
    if (problem := verify(path)) is not None:
        raise CheckpointError(problem)
    saved = read_metadata(path).state_dict_metadata
    model = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    dcp.load(model, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=True)
    tensors = {k.removeprefix("model."): v.to(EXPORT_DTYPES[dtype]).contiguous() for k, v in model.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata={"source": str(path), "dtype": dtype})
    else:
        torch.save(tensors, tmp)
    tmp.replace(out)
    logger.info("exported %d tensors of %s to %s (%s, %s)", len(tensors), path, out, fmt, dtype)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_exp.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's model as one safetensors / torch file")
    ex.add_argument("checkpoint", type=Path, help="a step-N dir, or a run dir / folder (its latest complete checkpoint)")
    ex.add_argument("--out", type=Path, help="output file (default: <checkpoint>/../../export/model.<format>)")
    ex.add_argument("--dtype", choices=list(EXPORT_DTYPES), default="float32")
    ex.add_argument("--format", choices=list(EXPORT_FORMATS), default="safetensors")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = args.checkpoint
    if read_marker(path) is None:  # a run dir or a folder: its latest complete checkpoint
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = complete_steps(folder)
        if not steps:
            parser.error(f"{path} holds no complete checkpoint (a step-N dir with {MARKER})")
        path = step_dir(folder, max(steps))
    out = args.out or path.parent.parent / "export" / EXPORT_FORMATS[args.format]
    try:
        export(path, out, args.dtype, args.format)
    except CheckpointError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
