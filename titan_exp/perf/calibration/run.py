"""Calibration through an executor: the job whose ranks measure a machine, started as training
ranks are (each runs titan_exp.perf.calibration.measure), and `cover`, which measures first what a
plan or an autotune sweep would otherwise estimate."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from titan_exp.config import JobConfig, to_yaml
from titan_exp.perf.calibration.timing import Options
from titan_exp.perf.model.shapes import tp_degrees
from titan_exp.perf.rates.profile import MachineProfile
from titan_exp.record import RunDir, Status
from titan_exp.validation import resolve

logger = logging.getLogger("titan_exp.calibrate")


def calibration_job(job: JobConfig, world: int | None = None) -> JobConfig:
    """The job whose ranks calibrate `job`'s model: `world` ranks (default: the job's world size)
    in one data-parallel group, which every executor and the validator accept."""
    world = world or job.world_size
    p = job.parallelism
    flat = dataclasses.replace(p, data_parallel_shard_degree=world, data_parallel_replicate_degree=1,
                               tensor_parallel_degree=1, pipeline_parallel_degree=1, context_parallel_degree=1)
    nnodes = job.cluster.nodes_for(world)
    job = dataclasses.replace(job, parallelism=flat,
                              training=dataclasses.replace(job.training, global_batch_size=-1, local_batch_size=1),
                              cluster=dataclasses.replace(job.cluster, nnodes=nnodes, nproc_per_node=world // nnodes))
    return resolve(job)


def run_calibration(job: JobConfig, options: Options, run_dir: RunDir) -> tuple[MachineProfile | None, str]:
    """Start `job`'s calibration ranks (a calibration_job) through its executor, each running
    titan_exp.perf.calibration.measure; (the profile they wrote, "") or (None, why not). On SLURM without
    cluster.wait the job is only queued: (None, "queued")."""
    from titan_exp.cluster import get_executor

    run_dir.path.mkdir(parents=True, exist_ok=True)
    run_dir.config.write_text(to_yaml(job))
    (run_dir.path / "calibrate.json").write_text(json.dumps(dataclasses.asdict(options)))
    error = get_executor(job.cluster.executor)(job, run_dir, in_sweep=False, entry="titan_exp.perf.calibration.measure")
    summary = run_dir.read_summary()
    if summary is not None and summary.status == Status.pending:
        return None, "queued"
    if error or summary is None or summary.status != Status.ok:
        return None, error or (summary.error if summary else "no summary written")
    return MachineProfile.from_dict(json.loads(Path(summary.machine_profile).read_text())), ""


def calibrate_missing(job: JobConfig, world: int, missing: list[str], *, compile: bool, run_dir: Path,
                      folder: Path | None = None,
                      say: Callable[[str], None] = logger.info) -> tuple[MachineProfile, float]:
    """Measure what a plan or an autotune sweep of `job` on `world` ranks would otherwise estimate
    (`missing`, from MachineProfile.missing), before it predicts anything: through the job's own
    executor, as `python -m titan_exp.perf.calibrate` would, but quick (Options.quick: about half
    its time). On a machine calibrated before, only the new model's blocks (and the compiled
    speed-up) are measured. The profile and the seconds it took, which the caller counts in the
    machine time it reports."""
    cal = calibration_job(job, world)
    say(f"calibrating first what the machine profile lacks: {'; '.join(missing)} "
        "(autotune.calibrate=false estimates it from FLOPs instead)")
    start = time.perf_counter()
    options = Options(quick=True, compile=compile, profile_dir=str(folder.resolve()) if folder else None)
    profile, error = run_calibration(cal, options, RunDir(run_dir))
    seconds = time.perf_counter() - start
    if profile is None:
        raise RuntimeError(f"calibrating {'; '.join(missing)} failed ({error}); see {run_dir}; "
                           "autotune.calibrate=false predicts from FLOPs instead")
    say(f"calibrated in {seconds:.0f} s: {profile.path(folder)}")
    return profile, seconds


@dataclass
class Coverage:
    """A profile after `cover`: what it lacked for the job, what it still lacks (estimated from
    FLOPs), and the seconds calibrating took (0: nothing was measured)."""

    profile: MachineProfile
    lacked: list[str]
    lacks: list[str]
    seconds: float


def cover(job: JobConfig, world: int, profile: MachineProfile, *, compile: bool, folder: Path | None,
          run_dir: Path, say: Callable[[str], None] = logger.info) -> Coverage:
    """`profile` with what it lacks for `job` on `world` ranks (MachineProfile.missing: the block at
    every TP degree, compile, the collectives) calibrated first, unless autotune.calibrate=false."""
    tps = tp_degrees(job.model, world)
    lacked = profile.missing(job, tps, compile=compile)
    if not lacked or not job.autotune.calibrate:
        return Coverage(profile, lacked, lacked, 0.0)
    profile, seconds = calibrate_missing(job, world, lacked, compile=compile, run_dir=run_dir, folder=folder, say=say)
    return Coverage(profile, lacked, profile.missing(job, tps, compile=compile), seconds)
