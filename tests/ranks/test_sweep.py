"""Sweeps: a real local multirun through `python launch.py -m`, its report, and the notebook."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, SMALL, compose, launch_cli

from titan_exp import report


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """6 members: lr in {8e-4, 4e-4, 1e6} x TP degree in {1, 3}. TP 3 does not divide the 16
    heads (invalid, no process started); lr 1e6 blows the loss up to NaN (failed); 2 are ok."""
    path = tmp_path_factory.mktemp("sweep")
    proc = launch_cli(["-m", *[o for o in SMALL if not o.startswith("training.steps")], "training.steps=3",
                       "optimizer.lr=8e-4,4e-4,1e6", "parallelism.tensor_parallel_degree=1,3",
                       f"hydra.sweep.dir={path}"], timeout=600)
    return path, proc


def test_sweep_records_every_member_and_exits_non_zero(sweep):
    path, proc = sweep
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "2 of 6 members ok (1 failed, 3 invalid, 2 ok)" in proc.stderr + proc.stdout
    statuses = {}
    for member in report.members(path):
        overrides = (member / ".hydra" / "overrides.yaml").read_text()
        summary = json.loads((member / "summary.json").read_text())
        statuses[member.name] = summary["status"]
        if "tensor_parallel_degree=3" in overrides:
            assert summary["status"] == "invalid" and "n_heads" in summary["error"]
            assert not (member / "logs").exists()  # nothing was started
        elif "1000000" in overrides:
            assert summary["status"] == "failed" and "loss nan" in summary["error"] and "not finite" in summary["error"]
        else:
            assert summary["status"] == "ok"
    assert sorted(statuses.values()) == ["failed", "invalid", "invalid", "invalid", "ok", "ok"]


def test_report_takes_its_numbers_from_the_summaries(sweep):
    path, _ = sweep
    rows = list(csv.DictReader((path / "report.csv").open()))
    assert [r["status"] for r in rows][:2] == ["ok", "ok"]
    ok = rows[:2]
    assert float(ok[0]["tokens_per_second_per_device"]) >= float(ok[1]["tokens_per_second_per_device"])
    for r in rows:
        summary = json.loads((path / r["member"] / "summary.json").read_text())
        assert r["status"] == summary["status"]
        if r["status"] == "ok":
            assert float(r["tokens_per_second_per_device"]) == pytest.approx(summary["tokens_per_second_per_device"])
            assert float(r["final_loss"]) == pytest.approx(summary["final_loss"])
            assert float(r["peak_memory_gib"]) == pytest.approx(summary["peak_memory_gib"])
            assert r["layout"] == "single" and r["world_size"] == "1"
        # The overrides column keeps only what differs between members.
        assert "training.seq_len" not in r["overrides"] and "optimizer.lr=" in r["overrides"]
    for plot in ("throughput.png", "memory.png", "loss.png"):
        assert (path / plot).stat().st_size > 1000
    assert "| 1 |" in (path / "report.md").read_text()
    assert "Members differ" not in (path / "report.md").read_text()  # one global batch and seq_len throughout


def markdown_table(report_md: str) -> list[list[str]]:
    """report.md's member table as rows of cells, the header first."""
    lines = [line for line in report_md.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_report_of_members_that_differ_in_global_batch(tmp_path):
    """The README's pitfall, cheaply: members whose global batch follows from another override
    (here the local batch, with global_batch_size=-1: local x dp) do different work per step. The
    report shows each member's global batch, sequence length and precision, says at its top and on
    loss.png that the members differ, and leaves out the columns no member has a value in (a dense
    model's EP and expert load, no held-out loss, no eval, no failure reason)."""
    from PIL import Image

    sweep = tmp_path / "sweep"
    proc = launch_cli(["-m", *[o for o in SMALL if not o.startswith(("training.steps", "training.global_batch"))],
                       "training.steps=3", "training.local_batch_size=2,4", f"hydra.sweep.dir={sweep}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (sweep / "report.md").read_text()
    assert "**Members differ in global batch 2 / 4 sequences**" in text, text
    assert "`training.global_batch_size=`" in text and "sequence length" not in text.split("\n")[2]
    header, *rows = markdown_table(text)
    assert {"global batch (sequences)", "seq len", "precision"} <= set(header)
    assert not {"EP", "max expert load", "val loss", "eval", "reason"} & set(header)
    by_member = {r[header.index("member")]: dict(zip(header, r)) for r in rows}
    assert [by_member[m]["global batch (sequences)"] for m in ("0", "1")] == ["2", "4"]
    assert all(r["seq len"] == "64" and r["precision"] == "fp32" for r in by_member.values())
    for j, name in enumerate(header):
        assert any(r[j] for r in rows), f"report.md column {name!r} is empty for every member"
    csv_rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert {"global_batch_size", "seq_len", "precision", "tokens_per_second_per_device_mean"} <= set(csv_rows[0])
    for name in csv_rows[0]:
        assert any(r[name] for r in csv_rows), f"report.csv column {name!r} is empty for every member"
    assert not {"ep", "expert_load", "final_val_loss", "reason"} & set(csv_rows[0])
    title = Image.open(sweep / "loss.png").text["Title"]
    assert title == "Not comparable step for step: members differ in global batch 2 / 4 sequences"


@pytest.mark.quick
def test_report_of_a_sweep_still_running(sweep, tmp_path):
    path, _ = sweep
    partial = tmp_path / "partial"
    shutil.copytree(path, partial)
    members = report.members(partial)
    (members[0] / "summary.json").unlink()
    (members[1] / "summary.json").write_text(json.dumps({"status": "running"}))
    proc = subprocess.run([sys.executable, "-m", "titan_exp.report", str(partial), "--no-plots"],
                          cwd=REPO, capture_output=True, text=True, check=True)
    assert "| pending |" in proc.stdout and "| running |" in proc.stdout
    statuses = {r["member"]: r["status"] for r in csv.DictReader((partial / "report.csv").open())}
    assert statuses[members[0].name] == "pending" and statuses[members[1].name] == "running"


@pytest.mark.quick
def test_named_sweep_presets_compose():
    """Each preset in sweeps/ is selectable (`+sweep=NAME`) and sweeps what it says."""
    for name in ("layouts_2", "ladder", "reshard", "ac", "pp_schedules"):
        cfg = compose([f"+sweep={name}"], with_hydra=True)
        assert cfg.hydra.sweeper.params, name
    assert compose(["+sweep=ladder", "+rung=3d"]).parallelism.pipeline_parallel_degree == 2


def test_notebook_runs_against_the_sweep(sweep, monkeypatch):
    """The analysis notebook executes top to bottom against a real sweep dir (nbclient)."""
    import nbformat
    from nbclient import NotebookClient

    path, _ = sweep
    monkeypatch.setenv("SWEEP_DIR", str(path))
    notebook = nbformat.read(REPO / "notebooks" / "sweep_analysis.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "\n".join(str(o.get("data", {}).get("text/plain", o.get("text", ""))) for o in outputs)
    assert "invalid" in text and "failed" in text  # the status counts
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_optuna_sweeper_optimises_the_objective(tmp_path):
    """Hydra's Optuna sweeper over the learning rate: each member returns its final loss
    (sweep.objective), so the study's best value is the lowest final loss of the members, and the
    report is written as for any sweep."""
    import yaml

    sweep = tmp_path / "optuna"
    result = launch_cli(["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.direction=minimize",
                         "hydra.sweeper.sampler.seed=0", "sweep.objective=final_loss",
                         "optimizer.lr=interval(1e-4,3e-3)", *SMALL, "training.steps=3", f"hydra.sweep.dir={sweep}"],
                        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    losses = [json.loads((d / "summary.json").read_text())["final_loss"] for d in sweep.iterdir()
              if (d / "summary.json").exists()]
    assert len(losses) == 3 and len(set(losses)) == 3  # three learning rates, three losses
    assert best["best_value"] == pytest.approx(min(losses))
    assert 1e-4 <= best["best_params"]["optimizer.lr"] <= 3e-3
    assert (sweep / "report.md").exists()
