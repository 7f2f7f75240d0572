"""The GPU tools' smoke modes: the same configurations, collection and report on CPU, so they
cannot rot between the sessions that have a GPU to run them on. All are `slow` (75-150 s each):
run `python -m pytest -m slow tests/test_gpu_suite.py` before a GPU session. Their calibration
and spec-sheet code is tested by default elsewhere (tests/test_gpu_model.py, test_perf.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest
from conftest import REPO

from benchmarks import gpu_grid


@pytest.mark.slow
def test_gpu_suite_smoke_writes_its_table_and_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    rows = {r["config"]: r for r in results["models"]["smoke"]}
    assert set(rows) >= {"bf16 eager", "bf16 + compile", "float8 tensorwise + compile", "float8 rowwise",
                         "bf16 + compile, AC selective", "bf16 + compile, AC full", "mxfp8",
                         "bf16 + compile, warm cache", "bf16 + compile, read every step"}
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r["reason"])
        assert r["tokens_per_second"] > 0 and r["peak_memory_gib"] > 0 and r["predicted_memory_gib"] > 0, name
        assert r["predicted_step_s"] > 0 and r["step_s"] > 0 and r["step_profile"] == "calibrated", name
        assert (r["mfu"] is None) == ("float8" in name or "mx" in name), name
    assert rows["bf16 + compile"]["compile_s"] > 0
    assert "skipped" in results["cuda_tests"]["summary"]  # collected, and skipped without a GPU
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| bf16 + compile, AC full | ok |" in table and "planner memory" in table
    assert "planner step time (calibrated profile)" in table and "reading the loss only on log steps" in table
    # --no-calibrate on a fresh machine, whose cache holds no profile yet (it stopped on the H200, 2026-11-28)
    fresh = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--smoke", "--configs", "bf16 eager",
                            "--no-tests", "--no-calibrate", "--out", str(tmp_path / "fresh")], cwd=REPO,
                           capture_output=True, text=True, timeout=900,
                           env={**os.environ, "TITAN_EXP_CACHE": str(tmp_path / "empty")})
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    row = json.loads((tmp_path / "fresh" / "gpu_suite.json").read_text())["models"]["smoke"][0]
    assert row["status"] == "ok" and row["step_profile"] != "calibrated"


@pytest.mark.slow
def test_gpu_grid_smoke_measures_every_member_and_scores_autotune(tmp_path):
    """benchmarks/gpu_grid.py (issue 38) on CPU: autotune's candidate set measured member by
    member beside its predictions, scored, then (in a second call that resumes the first, as a GPU
    session's time-limited calls do) the members it did not reach and the autotune sweep over the
    same axes, scored against the grid: the same code a GPU session runs."""
    smoke = [sys.executable, "-m", "benchmarks.gpu_grid", "--smoke"]
    grid = [*smoke, "--global-batch", "1", "--steps", "2", "--warmup", "1"]
    first = subprocess.run([*grid, "--out", str(tmp_path / "a")], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    earlier = json.loads((tmp_path / "a" / "gpu_grid.json").read_text())
    for row in earlier["rows"][8:]:  # as a call cut short by --budget-minutes leaves them
        row.update(status="skipped", reason="over --budget-minutes", tokens_per_second=None, step_s=None)
    (tmp_path / "a" / "gpu_grid.json").write_text(json.dumps(earlier))
    skipped = {"name": "x", "status": "skipped", "reason": "over --budget-minutes", "wall_s": 0.0, "step_s": None}
    assert "| x | skipped |" in gpu_grid.to_markdown({**earlier, "rows": [skipped]})  # as a cut call writes it
    out = subprocess.run([*grid, "--resume", str(tmp_path / "a" / "gpu_grid.json"), "--autotune", "--autotune-minutes",
                          "0.5", "--out", str(tmp_path / "b")], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "b" / "gpu_grid.json").read_text())
    rows = results["rows"]
    assert len(rows) == 3 * 2 * 2  # AC modes x compile x (fp32, bf16) at local batch 1
    assert [bool(r.get("resumed")) for r in rows] == [True] * 8 + [False] * 4
    assert [r["wall_s"] for r in rows[:8]] == [r["wall_s"] for r in earlier["rows"][:8]]
    assert all(r["status"] == "ok" and r["step_s"] > 0 and r["predicted_step_s"] > 0 for r in rows), rows
    assert results["scores"]["measured"] == 12 and "spearman" in results["scores"]["calibrated"]
    tune = results["autotune"]
    assert tune["status"] == "ok", tune
    assert tune["winner"] in {r["name"] for r in rows} and tune["winner_of_grid_best"] > 0
    assert "autotune:" in (tmp_path / "b" / "gpu_grid.md").read_text()
    assert json.loads((tmp_path / "b" / "autotune.json").read_text())["winner"]["name"] == tune["winner"]
    other = subprocess.run([*smoke, "--global-batch", "2", "--resume", str(tmp_path / "a" / "gpu_grid.json"),
                            "--no-calibrate", "--out", str(tmp_path / "c")], cwd=REPO, capture_output=True, text=True)
    assert other.returncode and "resume it with the same" in other.stderr, other.stderr[-2000:]


@pytest.mark.slow
def test_gpu_session_script_runs_its_stages_and_packs_what_they_wrote(tmp_path):
    """benchmarks/gpu_checks.sh, the one call a GPU session makes, then its `resume` on the same
    machine, with SMOKE=1: the smoke launch, the grid with its calibration, the suite's traced rows
    from that profile, then the autotune sweep against the grid, each packed for the device tool to
    bring back; and its `checks`, the named rows waiting for a GPU."""
    env = {**os.environ, "SMOKE": "1", "GPU_SESSION_DIR": str(tmp_path / "session"), "OUT": str(tmp_path / "out")}
    first = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "1", "0.5", "400"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "smoke rc=0" in first.stdout and "grid rc=0" in first.stdout and "suite rc=0" in first.stdout
    with tarfile.open(tmp_path / "out" / "gpu_session.tgz") as tgz:
        packed = set(tgz.getnames())
        assert {"./gpu.txt", "./smoke/summary.json", "./grid/gpu_grid.json", "./suite/gpu_suite.json"} <= packed
        assert json.load(tgz.extractfile("./smoke/summary.json"))["status"] == "ok"
        grid = json.load(tgz.extractfile("./grid/gpu_grid.json"))
        suite = json.load(tgz.extractfile("./suite/gpu_suite.json"))
    assert grid["rows"] and all(r["status"] in ("ok", "skipped") for r in grid["rows"]), grid["rows"]
    assert [r["config"] for r in suite["models"]["smoke"]] == [
        "bf16 + compile, traced", "float8 tensorwise + compile, traced", "float8 tensorwise + compile, AC full, traced"]
    assert all(r["status"] == "ok" for r in suite["models"]["smoke"]), suite["models"]["smoke"]
    resume = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "resume", "0.5", "400"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert resume.returncode == 0 and "grid and autotune rc=0" in resume.stdout, resume.stdout[-3000:]
    with tarfile.open(tmp_path / "out" / "gpu_session_resume.tgz") as tgz:
        rest = json.load(tgz.extractfile("grid2/gpu_grid.json"))
    assert all(r["status"] == "ok" for r in rest["rows"]) and rest["autotune"]["status"] == "ok", rest.get("autotune")
    checks = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "checks", "300"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert checks.returncode == 0 and "checks rc=0" in checks.stdout, checks.stdout[-3000:]
    with tarfile.open(tmp_path / "out" / "gpu_session_checks.tgz") as tgz:
        named = json.load(tgz.extractfile("checks/gpu_suite.json"))["models"]["smoke"]
    assert [(r["config"], r["status"]) for r in named] == [("MoE 8 experts top-2, bf16 + compile", "ok"),
                                                           ("bf16 eager, AC full", "ok")]


@pytest.mark.slow
def test_gpu_session_float8_stage_runs_each_row_under_its_own_inductor_settings(tmp_path):
    """`gpu_checks.sh float8`, a call of its own: the 3B's float8 and bf16 + compile rows, and the
    rows under Inductor settings (gpu_suite.INDUCTOR_ENV), each recording the variables it set; on
    CPU (SMOKE=1) they compile with aot_eager, so the settings are carried, not felt."""
    env = {**os.environ, "SMOKE": "1", "GPU_SESSION_DIR": str(tmp_path / "session"), "OUT": str(tmp_path / "out")}
    float8 = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "float8", "300"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert float8.returncode == 0 and "float8 rc=0" in float8.stdout, float8.stdout[-3000:]
    with tarfile.open(tmp_path / "out" / "gpu_session_float8.tgz") as tgz:
        rows = json.load(tgz.extractfile("float8/gpu_suite.json"))["models"]["smoke"]
    assert [(r["config"], r["status"], r["env"]) for r in rows] == [
        ("float8 tensorwise + compile", "ok", {}), ("bf16 + compile", "ok", {}),
        ("float8 tensorwise + compile, looped reductions", "ok", {"TORCHINDUCTOR_PERSISTENT_REDUCTIONS": "0"}),
        ("float8 tensorwise + compile, coordinate descent", "ok", {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}),
        ("bf16 + compile, coordinate descent", "ok", {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"})]


@pytest.mark.slow
def test_float8_partition_shows_the_backward_casting_recomputed_norm_outputs():
    """The premise of the suite's Inductor rows (gpu_suite.INDUCTOR_ENV): compiled, a float8 block's
    backward recomputes both norms' outputs from the block's input, its residual and their rsqrt,
    and casts them to float8 again for the weight gradients, where the attention's output it keeps
    in float8 from the forward."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.float8_partition"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    recomputed = [line for line in out.stdout.splitlines() if "an activation recomputed" in line]
    norms = [line for line in recomputed if "rsqrt" in line]
    assert len(norms) == 2 and all("[256, 256] to torch.float8_e4m3fn" in line for line in norms), out.stdout
    assert "torch.float8_e4m3fn" in out.stdout.split("the forward saves")[1].split("\n")[0], out.stdout
