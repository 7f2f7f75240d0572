"""`python -m benchmarks.published`: the validation runs to its summary, its tables hold every
held-out TorchTitan row in order, the checks named before measuring are reported, and what a
spec-sheet plan quotes of its accuracy (titan_exp/perf/rates/accuracy.json) is what `--record`
writes from this run. `python -m benchmarks.published.torchtitan` plans TorchTitan's tables."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys

import pytest
from conftest import REPO, job_config

from benchmarks.published import report
from titan_exp.perf.rates import accuracy
from titan_exp.validation import validate


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, dict]:
    """The validation's output, and the record `--record` wrote (to a copy of accuracy.json)."""
    copy = tmp_path_factory.mktemp("accuracy") / "accuracy.json"
    copy.write_text(accuracy.RECORDED.read_text())
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(accuracy, "RECORDED", copy)
        assert report.main(["--record", "today"]) == 0
    return out.getvalue(), json.loads(copy.read_text())["published"]


def test_the_recorded_accuracy_is_what_the_validation_measures_now(run):
    """The shipped record equals what this run writes, and what it printed: a change of the model
    that moves the validation's numbers records them again (`--record DATE`)."""
    out, written = run
    shipped = accuracy.published()
    assert {k: v for k, v in written.items() if k not in ("date", "command")} == {
        k: v for k, v in shipped.items() if k not in ("date", "command")}
    last = out.strip().splitlines()[-1]
    held = re.match(r"held-out: (\d+) rows from \d+ sources; tokens/s median \|error\| (\d+) %", last)
    assert held and (int(held[1]), int(held[2]) / 100) == (written["rows"], written["median_abs_error"])
    devices = next(line for line in out.splitlines() if line.startswith("By spec sheet"))
    quoted = {name: [int(n), int(signed) / 100, int(size) / 100] for name, n, signed, size in re.findall(
        r"(\w+) (\d+) rows?, median error ([+-]\d+) %, \|error\| (\d+) %", devices)}
    assert quoted == written["by_device"] and sum(n for n, _, _ in quoted.values()) == written["rows"]


def test_every_held_out_torchtitan_table_and_pair_is_in_order(run):
    out, _ = run
    assert "| torchtitan | compute_scale" in out and "| 5 of 5 | 19 of 19 |" in out
    cp = [line for line in out.splitlines() if "| context parallel |" in line]  # each doubling of CP and sequence
    assert len(cp) == 6 and "| Table 2: FSDP 8, CP 1 -> FSDP 4, CP 2 | -35 % |" in cp[0]
    assert "Held-out techniques within 5 points of their published effect: " in out


def test_the_named_checks_are_reported(run):
    """Megatron-Bridge's 25.09 rows on a line of their own (13 dense and 13 MoE planned), and one
    configuration on two GPUs with what their recipes differed in."""
    out, _ = run
    named = next(line for line in out.splitlines() if line.startswith("Held-out check of Megatron-Bridge's 25.09"))
    assert re.search(r": dense 13 rows, median \|error\| \d+ %, worst [+-]\d+ %; MoE 13 rows, ", named)
    assert "One configuration on two GPUs in a held-out table (gpu_pairs), the first's tokens/s over the second's: " \
        "gb300 over gb200, 8 configurations: published 1.23 (1.15-1.27)" in out
    assert "their recipes differing in cpu_offloading_num_layers 20 vs 40 (4)" in out


def test_record_quotes_every_source_only():
    with pytest.raises(SystemExit) as refused:
        report.main(["--record", "today", "--source", "torchtitan"])
    assert refused.value.code == 2


def test_torchtitans_published_tables_validate_and_plan_for_cuda():
    """Every configuration of TorchTitan's published H100 tables validates for CUDA and is
    predicted. A refusal seen on CPU over gloo (full AC with compile and TP) stays on CPU."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.published.torchtitan"], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 18 and {line.split("|")[1].strip()[0] for line in rows} == set("123456")
    assert "held-out rows: 13 for tokens/s, 18 for memory (none fitted);" in out.stdout
    assert "within 10 %: 18;" in out.stdout  # every published peak, counted
    assert "| 4 (fit: tokens/s) | 2D + async TP |" in out.stdout  # in the validation's fitting set: not scored
    cpu = job_config(["parallelism=tp", "compile.enable=true", "activation_checkpoint.mode=full"])
    assert any("fails on CPU" in e for e in validate(cpu, cuda=False)) and validate(cpu, cuda=True) == []
