"""The checkpoint folder on disk: which checkpoints exist, whether each is whole, and reading
them safely.

    <folder>/step-N/.metadata, __R_I.distcp   one DCP checkpoint, written by every rank
    <folder>/step-N/complete.json             written last, by rank 0, once every rank finished

A step dir without `complete.json` is an interrupted save: it is never loaded, and it is removed
when the next run starts. `complete.json` lists each file's size and CRC32, so a truncated or
corrupted shard is named before anything is read from it.

Loading never unpickles arbitrary objects: DCP's `.metadata` is read with an unpickler that
admits only DCP's own metadata classes, and the few non-tensor values (scheduler and optimizer
hyperparameters, the data position) load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titan_exp.config import CheckpointConfig

MARKER = "complete.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# dtypes of model-only checkpoints and exports (checkpoint.export_dtype)
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# file names of exports (checkpoint.export_format)
EXPORT_FORMATS = {"safetensors": "model.safetensors", "pt": "model.pt", "hf": "hf"}  # hf: a directory


class CheckpointError(RuntimeError):
    pass


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


def crc32(path: Path) -> int:
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
        if crc32(file) != crc:
            return f"{file} is corrupted: its checksum differs from the one recorded when it was saved"
    return None


def not_a_checkpoint(path: Path, *, hf: bool = False) -> str | None:
    """Why `path`, given as the checkpoint to start from, is no checkpoint at all: missing, a
    file, a folder of step dirs or a run dir rather than one step dir, or a directory no save
    wrote into. None for a step dir, complete or not (`verify` names what is wrong with a save
    that never finished), and with `hf` for any directory (a Hugging Face model's)."""
    wanted = "a Hugging Face model directory" if hf else "a step-N dir a run saved (<run dir>/checkpoints/step-N)"
    if not path.exists():
        return f"does not exist; give {wanted}"
    if not path.is_dir():
        return f"is a file, not a directory; give {wanted}"
    if hf or read_marker(path) is not None or _STEP_DIR.match(path.name) or (path / ".metadata").exists():
        return None
    for folder in (path, path / "checkpoints"):
        if steps := complete_steps(folder):
            return f"holds checkpoints but is not one; give one of them, e.g. {step_dir(folder, max(steps))}"
    if (path / "config.json").is_file():
        return (f"holds no checkpoint (no {MARKER}); for a Hugging Face model directory set "
                "checkpoint.initial_load_in_hf=true")
    return f"holds no checkpoint (no {MARKER}); give {wanted}"


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
        ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, "
                                     "which a DCP checkpoint never holds")


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


def optimizer_states(keys: Any) -> dict[str, set[str]]:
    """Parameter FQN -> the names of its optimizer state, from flattened checkpoint keys
    (`optimizer.state.<fqn>.<name>`)."""
    held: dict[str, set[str]] = {}
    for key in keys:
        if key.startswith("optimizer.state."):
            fqn, _, name = key.removeprefix("optimizer.state.").rpartition(".")
            held.setdefault(fqn, set()).add(name)
    return held


def optimizer_mismatch(path: Path, saved: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """Why the optimizer state of checkpoint `path` (`saved`: its metadata's state_dict_metadata)
    cannot load into this run's optimizer, whose state of each parameter FQN has the names in
    `expected` (AdamW's exp_avg, exp_avg_sq, step; Muon's momentum_buffer); None when it can.
    One optimizer's state is not another's (AdamW's second moment has no Muon counterpart, and
    Muon's momentum is not AdamW's first moment for the step count it lacks), so none is converted."""
    held = optimizer_states(saved)
    for fqn, names in expected.items():
        if fqn in held and held[fqn] != set(names):
            return (f"checkpoint {path} holds optimizer state {', '.join(sorted(held[fqn]))} for {fqn}, where this "
                    f"run's optimizer keeps {', '.join(sorted(names))}: optimizer state loads only into the optimizer "
                    "that saved it (optimizer=adamw and optimizer=muon keep different state). Resume with the "
                    "optimizer it was saved with, or start a new run dir from its weights alone: "
                    f"checkpoint.initial_load_path={path} checkpoint.initial_load_model_only=true")
    return None


def describe_mismatch(path: Path, wrong: list[str]) -> str:
    more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
    return (f"checkpoint {path} does not fit this model: {'; '.join(wrong[:3])}{more}. It was saved from a "
            "different model shape: use a checkpoint of this model, or another run dir / checkpoint.folder")
