"""The run directory: the one record of a run that every other tool reads.

    <run dir>/config.yaml      the resolved config the ranks were built from
    <run dir>/tokenizer.json   the tokenizer the run used (a copy, so the run is self-contained)
    <run dir>/metrics.jsonl    one line per logged step
    <run dir>/summary.json     status, throughput, MFU, memory, losses: always written
    <run dir>/logs/rank-K.log  each rank's log
    <run dir>/slurm_job.json   the SLURM job (id, log paths, code snapshot), cluster=slurm only
    <run dir>/checkpoints/step-N/   DCP checkpoints (titan_exp.checkpoint), when enabled
    <run dir>/export/model.safetensors   the final model alone (checkpoint.export_format)
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

# pending: submitted to SLURM, not started; interrupted: stopped by a signal at a step boundary
# (resumable); cancelled: the SLURM job was cancelled.
STATUSES = ("ok", "failed", "oom", "invalid", "running", "pending", "interrupted", "cancelled")
FINAL = ("ok", "failed", "oom", "invalid", "cancelled")  # nothing that happens later changes these


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    config = property(lambda self: self.path / "config.yaml")
    tokenizer = property(lambda self: self.path / "tokenizer.json")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    logs = property(lambda self: self.path / "logs")
    slurm_job = property(lambda self: self.path / "slurm_job.json")

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Atomic, so a reader never sees half a summary."""
        assert summary["status"] in STATUSES, summary["status"]
        self.path.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".summary.")
        with os.fdopen(fd, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        os.replace(tmp, self.summary)

    def read_summary(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.summary.read_text())
        except FileNotFoundError:
            return None

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line]
