"""What the benchmarks share: a job launched as `python launch.py OVERRIDES` would launch it."""

from __future__ import annotations

import json
from pathlib import Path

from titan_exp.config import compose
from titan_exp.launch import launch

REPO = Path(__file__).resolve().parents[1]


def run_job(overrides: list[str], run_dir: Path, *, multirun: bool = False) -> tuple[int, dict | None]:
    """Launch through titan_exp.launch (ranks are real processes); (exit code, summary.json as read)."""
    code = launch(compose(overrides), str(run_dir), multirun=multirun)
    path = Path(run_dir) / "summary.json"
    return code, json.loads(path.read_text()) if path.exists() else None
