"""Export: a checkpoint's model alone, in one file (safetensors or torch's format), as a library
call and as `python -m titan_exp.checkpoint export RUN`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_exp.checkpoint.store import (
    EXPORT_DTYPES,
    EXPORT_FORMATS,
    MARKER,
    CheckpointError,
    SafePlanner,
    SafeReader,
    complete_steps,
    read_marker,
    read_metadata,
    step_dir,
    verify,
)

logger = logging.getLogger("titan_exp.checkpoint")


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
    parser = argparse.ArgumentParser(prog="python -m titan_exp.checkpoint", description="Export a checkpoint's model as one file.")
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
