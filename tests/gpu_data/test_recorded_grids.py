"""The recorded H200 grids (benchmarks/data/gpu_h200_grid*.json) are what benchmarks/gpu_grid.py
writes: their scores and autotune's result are the benchmark's scoring of their own rows, so a
file edited by hand, or a change to the scoring, shows here. What the planner predicts for those
rows now is checked in test_gpu_h200_grid.py and test_gpu_h200_1b_tied.py."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from benchmarks.gpu_grid import of_grid_best, scores

pytestmark = pytest.mark.quick

GRIDS = sorted(p.name for p in (REPO / "benchmarks" / "data").glob("gpu_h200_grid*.json")
               if not p.name.endswith("_profile.json"))


@pytest.fixture(params=GRIDS)
def grid(request) -> dict:
    return json.loads((REPO / "benchmarks" / "data" / request.param).read_text())


def test_every_grid_is_recorded(grid):
    assert len(GRIDS) == 4 and (REPO / "benchmarks" / "data" / grid["profile"]).exists()
    assert {"device", "driver", "torch", "torchao", "date", "commands"} <= set(grid)


def test_a_grids_scores_are_its_rows_scores(grid):
    recorded, now = grid["scores_on_the_gpu"], scores(grid["rows"])
    assert (now["best"], now["measured"], now["members"]) == (recorded["best"], recorded["measured"],
                                                             recorded["members"])
    for part in ("calibrated", "spec", "memory"):
        assert now[part] == pytest.approx(recorded[part], rel=1e-9), part


def test_autotunes_result_is_its_winner_as_the_grid_measured_it(grid):
    at = grid["autotune"]
    assert at["status"] == "ok" and at["winner"] in {r["name"] for r in grid["rows"]}
    assert at["winner_of_grid_best"] == pytest.approx(of_grid_best(at["winner"], grid["rows"]), rel=1e-12)
    assert at["time_share"] == pytest.approx(at["wall_s"] / grid["scores_on_the_gpu"]["grid_s"], rel=1e-12)
    if "autotune_record" in grid:
        assert grid["autotune_record"]["winner"]["name"] == at["winner"]
