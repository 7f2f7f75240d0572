from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# What the tests import from here: a job launched as the benchmarks launch one, the composed config.
from benchmarks.common import run_job  # noqa: F401
from titan_exp.config import compose, compose_job  # noqa: F401

REPO = Path(__file__).resolve().parents[1]

# The smallest job that still trains for real: debug model, 5 steps of 8 x 64 tokens, fp32,
# deterministic, the same global batch whatever the layout, so losses compare across layouts.
SMALL = [
    "training.steps=5",
    "training.seq_len=64",
    "training.global_batch_size=8",
    "training.deterministic=true",
    "metrics.log_freq=1",
]

# The held-out loss at the last step of SMALL, on one global batch of the bundled validation set.
VALIDATION = ["validation.enable=true", "validation.freq=5", "validation.steps=1"]


@pytest.fixture(scope="session", autouse=True)
def titan_cache(tmp_path_factory):
    """One asset cache (corpus, tokenizer) for the session, never the user's."""
    path = tmp_path_factory.mktemp("titan_cache")
    os.environ["TITAN_EXP_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def rank_forkserver(titan_cache):
    """The local ranks' forkserver (titan_exp.cluster.forkserver) started in the session's
    environment: started by the first test to launch, it would keep what that test set (monkeypatch)."""
    from titan_exp.cluster import forkserver

    forkserver.ready()


job_config = compose_job  # the JobConfig `python launch.py <overrides>` would run


def as_ran(data: dict) -> list[str]:
    """Overrides for the model a recorded GPU run held (benchmarks/data): the 1B's and 3B's runs up
    to 2026-11-28 trained an untied output projection (to_empty had given it a Parameter of its
    own), which their files say in `model_ran_untied`."""
    return ["model.tie_word_embeddings=false"] if data.get("model_ran_untied") else []


def errors(predicted: list[float], measured: list[float]) -> list[float]:
    """|predicted / measured - 1| of each pair (step seconds, GiB)."""
    return [abs(p / m - 1) for p, m in zip(predicted, measured)]


def rank_correlation(predicted_s: list[float], measured_s: list[float]) -> float:
    """Spearman's rank correlation of tokens/s, predicted against measured, from step seconds."""
    from titan_exp.perf.calibration.fit import spearman

    return spearman([1 / p for p in predicted_s], [1 / m for m in measured_s])


def read_summary(run_dir: Path) -> dict | None:
    """summary.json as a user (or a script) reads it."""
    path = Path(run_dir) / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def launch_cli(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`python launch.py ARGS` from the repo root, as a user types it."""
    return subprocess.run(
        [sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def logged_steps(run_dir: Path) -> int:
    """Lines in the run's metrics.jsonl so far (one per step with metrics.log_freq=1)."""
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def rank_pids(run_dir: Path) -> list[int]:
    """The live rank processes of the run in run_dir: each rank log's latest process (its "(pid N)"
    line; forked from the launcher's forkserver, a rank's command line is the server's)."""
    pids = []
    for log in (run_dir / "logs").glob("rank-*.log"):
        found = re.findall(r"titan_exp from \S+, on host \S+ \(pid (\d+)\)", log.read_text())
        if found and Path("/proc", found[-1]).exists():
            pids.append(int(found[-1]))
    return pids


def losses_by_step(run_dir: Path) -> list[float]:
    """Every logged step's loss from metrics.jsonl, the last record of a step winning: across the
    segments of a run that was stopped and resumed, what one uninterrupted run would have logged."""
    steps = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["loss"]
    return [steps[s] for s in sorted(steps)]


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The fp32 single-process run of SMALL (with its held-out loss) that every layout and
    feature is compared with."""
    code, summary = run_job([*SMALL, *VALIDATION], tmp_path_factory.mktemp("reference"))
    assert code == 0, summary
    return summary


@pytest.fixture(scope="session")
def bf16_reference(tmp_path_factory):
    """The bf16 (autocast) single-process run of SMALL, compared with fp32 (test_parallel) and with
    the low precisions (test_precision): run once, since bf16 is slow on CPUs without AVX512-BF16."""
    code, summary = run_job([*SMALL, "precision=bf16"], tmp_path_factory.mktemp("bf16"))
    assert code == 0, summary
    return summary


# --- SLURM: the controller of scripts/local_slurm.sh, and its namespaced nodes ----------------------

def _slurm_or_skip(answers: bool, what: str, start: str) -> None:
    """Go on where `what` answers; else skip, or fail where TITAN_EXP_REQUIRE_SLURM=1 (CI), naming
    the command that starts it."""
    if not answers:
        if os.environ.get("TITAN_EXP_REQUIRE_SLURM") == "1":
            pytest.fail(f"no {what} answers; run `{start}`")
        pytest.skip(f"no {what} (`{start}` starts one)")


@pytest.fixture(scope="module")
def slurm():
    """A SLURM controller answers."""
    from slurm_jobs import slurm_up

    _slurm_or_skip(slurm_up(), "SLURM controller", "bash scripts/local_slurm.sh")


@pytest.fixture(scope="module")
def nodes():
    """The 3-node `nodes` partition of `scripts/local_slurm.sh nodes 3`, its node names."""
    from slurm_jobs import partition_nodes, slurm_up

    _slurm_or_skip(slurm_up() and len(partition_nodes()) >= 3, "3-node `nodes` partition",
                   "bash scripts/local_slurm.sh nodes 3")
    return partition_nodes()
