"""The evaluator: a process of its own that scores a Hugging Face model directory with lm-eval,
after writing that directory from a run's model-only checkpoint when asked (`--export`).

    python -m titan_exp.eval MODEL_DIR --tasks tiny_mc [--include-path DIR] [--limit N]
        [--batch-size B] [--device cpu] [--out results.json] [--export CHECKPOINT --run-dir RUN]

The trainer starts it (titan_exp.eval.runner) with the Hugging Face libraries offline; by hand it
scores any Llama directory the same way. It runs in --include-path, so the relative `data_files`
of the task YAMLs there are read from that directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from titan_exp.checkpoint.export import export
from titan_exp.checkpoint.store import MARKER, CheckpointError
from titan_exp.config import load_job_config
from titan_exp.eval.tasks import metrics_of, task_manager
from titan_exp.files import atomic_write
from titan_exp.precision import torchao_imports
from titan_exp.record import RunDir

logger = logging.getLogger("titan_exp.eval")

RESULTS = "results.json"
LOG = "eval.log"


def export_model(checkpoint: Path, run_dir: RunDir, out: Path) -> Path:
    """The run's model-only checkpoint `checkpoint` as a Hugging Face Llama directory `out` that
    lm-eval loads offline (weights in checkpoint.export_dtype, the run's tokenizer); the
    checkpoint is removed once written."""
    job = load_job_config(run_dir.config)
    export(checkpoint, out, job.checkpoint.export_dtype.value, "hf", model=job.model, tokenizer=run_dir.tokenizer)
    (checkpoint / MARKER).unlink(missing_ok=True)  # first: a crash halfway leaves an incomplete dir
    shutil.rmtree(checkpoint, ignore_errors=True)
    return out


def evaluate(model_dir: Path, tasks: list[str], *, include_path: str | None = None, limit: int | None = None,
             batch_size: int = 8, device: str = "cpu") -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of the directory with its `hf` model (the dtype its config.json
    names); lm-eval's whole record."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(model_dir), "dtype": "auto"}, tasks=list(tasks),
        task_manager=task_manager(list(tasks), include_path), limit=limit, batch_size=batch_size, device=device,
        log_samples=False,
    )


def record(raw: dict[str, Any], seconds: float) -> dict[str, Any]:
    """results.json: the {task: {metric: value}} table, and what lm-eval says of its run."""
    import lm_eval

    kept = {k: raw.get(k) for k in ("results", "versions", "n-samples", "configs")}
    return {"eval": metrics_of(raw["results"]), "seconds": round(seconds, 3),
            "lm_eval": {"version": getattr(lm_eval, "__version__", None), **kept}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_exp.eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a Hugging Face Llama directory (written first with --export)")
    parser.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names")
    parser.add_argument("--include-path", type=Path, help="a directory of your own task YAMLs (relative: to the "
                        "current directory)")
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, help=f"where the results go (default: MODEL/{RESULTS})")
    parser.add_argument("--export", type=Path, metavar="CHECKPOINT", help="a run's model-only DCP checkpoint to write "
                        "MODEL from (and remove)")
    parser.add_argument("--run-dir", type=Path, help="with --export: the run (its config.yaml and tokenizer)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    # Paths as the caller gave them, from the caller's directory: the evaluation runs in --include-path.
    include = None if args.include_path is None else args.include_path.expanduser().resolve()
    if include is not None and not include.is_dir():
        parser.error(f"--include-path {args.include_path}: not a directory; give the one that holds your task YAMLs")
    if args.export is not None:
        if args.run_dir is None:
            parser.error("--export needs --run-dir (the run's config.yaml gives the model's shapes)")
        start = time.perf_counter()
        try:
            export_model(args.export, RunDir(args.run_dir), args.model)
        except CheckpointError as exc:
            parser.error(f"--export {args.export}: {exc}")
        logger.info("exported %s to %s in %.1f s", args.export, args.model, time.perf_counter() - start)
    model, out = args.model.resolve(), (args.out or args.model / RESULTS).resolve()
    if include is not None:
        os.chdir(include)  # relative data_files in the task YAMLs are read from there
    start = time.perf_counter()
    with torchao_imports():  # transformers imports torchao (its quantizers) along the way
        raw = evaluate(model, args.tasks, include_path=None if include is None else str(include), limit=args.limit,
                       batch_size=args.batch_size, device=args.device)
    result = record(raw, time.perf_counter() - start)
    atomic_write(out, json.dumps(result, indent=2, default=str))
    logger.info("evaluated %s in %.1f s: %s", args.model, result["seconds"], json.dumps(result["eval"]))
    return 0
