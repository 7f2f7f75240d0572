"""The code reads as it is now: ruff's checks (pyproject.toml: pyflakes, pycodestyle, import order,
lines of at most 120 characters) pass over the repository, and the package's code carries no
history (issue numbers, dates) and names no file outside the repository. Each check is shown to
fail on a sample that breaks it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.quick

HISTORY = re.compile(r"issue [0-9]+|20[0-9]{2}-[01][0-9]-[0-3][0-9]")
OUTSIDE = re.compile(r"FACTS\.md|DEVELOPERS\.md|\.\./shared|wheels\.sh")


def ruff(*paths: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *map(str, paths)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def offending(pattern: re.Pattern, files: list[Path]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in files
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]


def test_ruff_passes():
    out = ruff(".")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_fails_on_a_long_line_and_an_unused_import(tmp_path):
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import os\n\nx = '" + "y" * 120 + "'\n")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "bad.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "E501" in out.stdout and "F401" in out.stdout


def test_the_package_carries_no_history_and_names_nothing_outside_the_repo():
    code = sorted((REPO / "titan_exp").rglob("*.py"))
    assert offending(HISTORY, code) == []
    everything = [p for p in code + sorted((REPO / "tests").rglob("*.py")) + sorted((REPO / "benchmarks").rglob("*.py"))
                  if p.resolve() != Path(__file__).resolve()]
    assert offending(OUTSIDE, everything) == []


def test_the_history_check_finds_an_issue_number_and_a_date(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("x = 1  # fixed for issue 12\ny = 2  # measured 2026-11-24\nz = 3  # pytorch/pytorch#150859\n")
    found = [line for line in sample.read_text().splitlines() if HISTORY.search(line)]
    assert found == ["x = 1  # fixed for issue 12", "y = 2  # measured 2026-11-24"]
