"""The run record: summary.json is written and read through one type, RunSummary."""

from __future__ import annotations

import json

import pytest
from conftest import job_config

from titan_exp.record import FINAL, RunDir, RunSummary, Status


@pytest.mark.quick
def test_summary_round_trips_through_the_file(tmp_path):
    job = job_config(["parallelism=3d"])
    summary = RunSummary.of(job, Status.pending, tmp_path, slurm_job_id="12_3")
    RunDir(tmp_path).write_summary(summary)
    raw = json.loads((tmp_path / "summary.json").read_text())
    # Plain JSON: the status as its string, the layout by mesh dim, fields that do not apply left out.
    assert raw["status"] == "pending" and raw["world_size"] == 8 and raw["layout"]["pp"] == 2
    assert "final_loss" not in raw and "error" not in raw
    back = RunDir(tmp_path).read_summary()
    assert back == summary and back.status is Status.pending and back.status not in FINAL


def test_summary_fields_are_typed(tmp_path):
    summary = RunSummary(status=Status.ok)
    with pytest.raises(TypeError):
        summary.replace(final_los=1.0)  # a misspelt field is an error, not a new key
    # A file from an older version with a key this one no longer has still reads.
    (tmp_path / "summary.json").write_text(json.dumps({"status": "failed", "error": "x", "retired_key": 1}))
    assert RunDir(tmp_path).read_summary() == RunSummary(status=Status.failed, error="x")
