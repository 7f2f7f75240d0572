"""Export: a checkpoint's model alone, in one file (safetensors or torch's format) or as a
Hugging Face directory (Llama, Qwen3, Qwen3-MoE) that `transformers` loads (weights, config.json and the run's
tokenizer), as a library call and as `python -m titan_exp.checkpoint export RUN [--format safetensors|pt|hf]`."""

from __future__ import annotations

import argparse
import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

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
    checkpoint_folder,
    complete_steps,
    read_marker,
    read_metadata,
    step_dir,
    verify,
)
from titan_exp.config import JobConfig, ModelConfig, load_job_config
from titan_exp.models import hf
from titan_exp.record import RunDir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("titan_exp.checkpoint")


def export_last(job: JobConfig, run_dir: RunDir, write: bool) -> list[Path]:
    """Where a run's last checkpoint is exported at the end of training: as one file
    (`checkpoint.export_format`) and as a Hugging Face directory with the run's tokenizer
    (`checkpoint.last_save_in_hf`); written only if `write` (one rank writes them)."""
    ckpt = job.checkpoint
    formats = [*([ckpt.export_format.value] if ckpt.export_format is not None else []),
               *(["hf"] if ckpt.last_save_in_hf else [])]
    if not ckpt.enable:
        return []
    outs = [run_dir.path / "export" / EXPORT_FORMATS[f] for f in formats]
    if write:
        last = step_dir(checkpoint_folder(ckpt, run_dir.path), job.training.steps)
        for fmt, out in zip(formats, outs):
            export(last, out, ckpt.export_dtype.value, fmt, model=job.model, tokenizer=run_dir.tokenizer)
    return outs


def export(path: Path, out: Path, dtype: str = "float32", fmt: str = "safetensors", *,
           model: ModelConfig | None = None, tokenizer: Path | None = None) -> Path:
    """Consolidate the model of checkpoint `path` (no process group needed): one safetensors
    file, torch's format (a plain dict of tensors, loadable with weights_only=True), or (hf, which
    needs the `model` shapes and the run's `tokenizer`) a Hugging Face directory. A
    tokenizer that cannot be exported is refused before anything is read or written."""
    if (problem := verify(path)) is not None:
        raise CheckpointError(problem)
    hf_tokenizer = _hf_tokenizer(model, tokenizer) if fmt == "hf" else None
    saved = read_metadata(path).state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # torch warns of a single-process load even when asked for one (no_dist)
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=True)
    tensors = {k.removeprefix("model."): v.to(EXPORT_DTYPES[dtype]).contiguous() for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    if hf_tokenizer is not None:
        hf.save(tensors, model, out, dtype, hf_tokenizer)
        logger.info("exported %d tensors of %s to %s (Hugging Face, %s, with the tokenizer %s)", len(tensors),
                    path, out, dtype, tokenizer)
        return out
    tmp = out.with_name(f".{out.name}.tmp")
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, tmp, metadata={"source": str(path), "dtype": dtype})
    else:
        torch.save(tensors, tmp)
    tmp.replace(out)
    logger.info("exported %d tensors of %s to %s (%s, %s)", len(tensors), path, out, fmt, dtype)
    return out


def _hf_tokenizer(model: ModelConfig | None, tokenizer: Path | None) -> PreTrainedTokenizerBase:
    """The run's tokenizer as the Hugging Face directory holds it; CheckpointError saying why not."""
    if model is None:
        raise CheckpointError("a Hugging Face export needs the model's shapes (its run's config.yaml)")
    if tokenizer is None:
        raise CheckpointError("a Hugging Face export holds the run's tokenizer: give its tokenizer.json")
    try:
        return hf.hf_tokenizer(tokenizer, model)
    except ValueError as exc:
        raise CheckpointError(f"cannot export the tokenizer: {exc}") from exc


def _run_of(parser: argparse.ArgumentParser, path: Path, args: argparse.Namespace) -> tuple[ModelConfig, Path]:
    """What a Hugging Face export of checkpoint `path` needs from its run: the model's shapes
    (--config, or the nearest config.yaml above it) and the tokenizer (--tokenizer, or the one
    beside that config.yaml); a one-line error when either is not there."""
    config = args.config or next((d / "config.yaml" for d in path.resolve().parents
                                  if (d / "config.yaml").is_file()), None)
    if config is None:
        parser.error(f"no config.yaml above {path}: give the run's with --config, for the model's shapes")
    tokenizer = args.tokenizer or RunDir(config.parent).tokenizer
    if not tokenizer.exists():
        parser.error(f"no tokenizer at {tokenizer}: give the run's tokenizer.json (or its directory) with "
                     "--tokenizer; a Hugging Face export holds it")
    return load_job_config(config).model, tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_exp.checkpoint",
                                     description="Export a checkpoint's model as one file or a Hugging Face directory.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write a checkpoint's model as one safetensors / torch file")
    ex.add_argument("checkpoint", type=Path,
                    help="a step-N dir, or a run dir / folder (its latest complete checkpoint)")
    ex.add_argument("--out", type=Path, help="output file (default: <checkpoint>/../../export/model.<format>)")
    ex.add_argument("--dtype", choices=list(EXPORT_DTYPES), default="float32")
    ex.add_argument("--format", choices=list(EXPORT_FORMATS), default="safetensors",
                    help="hf: a Hugging Face Llama directory (config.json, model.safetensors, the run's tokenizer) "
                    "for transformers")
    ex.add_argument("--config", type=Path,
                    help="hf: the run's config.yaml (default: the nearest one above the checkpoint)")
    ex.add_argument("--tokenizer", type=Path,
                    help="hf: the run's tokenizer.json, or a directory holding one (default: the one beside "
                    "its config.yaml)")
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
    model, tokenizer = _run_of(parser, path, args) if args.format == "hf" else (None, None)
    try:
        export(path, out, args.dtype, args.format, model=model, tokenizer=tokenizer)
    except CheckpointError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
