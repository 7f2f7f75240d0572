"""What every rank of a calibration job runs: `python -m titan_exp.perf.calibration.measure RUN_DIR`
(started by an executor, like training; `python -m titan_exp.perf.calibrate` is the command).

All ranks measure at the same time, as they would compute during training, so a machine with
fewer cores than ranks shows it in every number. What is compared (a line's sizes, two models'
difference) is timed side by side in rounds (in_rounds), so a slow spell of the machine spoils a
round, not the comparison. Rank 0 writes the profile (perf.rates.profile) and the
run's summary.json. What is measured, each over a few sizes and fitted as a Line:

- matmuls of the model's own GEMM shapes (fp32, bf16; float8 on GPUs that have it);
- on a CPU (a GPU's blocks are priced from its kernels, below, and not timed):
  one block by itself at every TP degree the world allows (heads and the SwiGLU width divided by
  tp), forward and forward + backward: its compute, and the forward that AC redoes, scaled by how
  much more a block costs inside the real model (measured at tp 1);
- the real model, forward + backward with its loss, with 1 and 3 blocks, at every TP degree
  (tensor + sequence parallel when tp > 1): the rest of the model (the 1-block model minus its
  block), and what TP adds (a real TP block, half of 3 blocks minus 1, minus its compute), and
  under TP the optimizer phase (gradient norm, clipping, AdamW) of both models; the blocks by
  themselves and the real models of every TP degree are timed in the same rounds
  (measure_compute), since each of these is a comparison between them;
- on a CPU, a real context-parallel block at every CP degree: what CP adds to the block;
- on a CPU, a real FSDP block (fully_shard, resharded after forward) at every shard degree: what FSDP adds
  to the block: its two all-gathers and reduce-scatter with their copies, the buffers it maps
  afresh (under the job's cluster.cpu_malloc_mmap_threshold_mib) and the waits for other ranks;
- collectives over groups of every size dividing the world, all groups at once: all-gather,
  reduce-scatter, all-reduce, all-to-all; send/recv between rank pairs;
- how many ranks compute at full speed at once (a block alone on rank 0 vs on every rank);
- how much of an all-gather hides behind a concurrent matmul;
- AdamW's step per parameter, on as many parameters as the model has; on a CPU, what memory
  fresh from the OS costs to touch (page faults); optionally (`compile`), on a CPU, the compiled
  block's speed-up.
- what each kind of kernel achieves (measure_kernels): the best-shaped GEMM by dtype, flash
  attention by sequence, memory-bound kernels, host time per op (and per compiled kernel with
  `compile`): the rates a GPU's plan prices its blocks at (perf.model.block).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_exp.config import JobConfig, ModelConfig, load_job_config
from titan_exp.perf.calibration.comm import measure_collectives, measure_overlap
from titan_exp.perf.calibration.compute import (
    concurrency,
    measure_compile,
    measure_compute,
    measure_cp_blocks,
    measure_fresh_memory,
    measure_fsdp_blocks,
    measure_gemms,
    measure_optimizer,
)
from titan_exp.perf.calibration.kernels import host_compiled_s, host_float8_s, measure_kernels
from titan_exp.perf.calibration.timing import Options
from titan_exp.perf.rates.profile import BlockCost, Line, MachineProfile, find, machine_key, model_shape, rank_key
from titan_exp.record import RunDir, RunSummary, Status
from titan_exp.train.rank import init_distributed, setup_logging, slurm_job_id

logger = logging.getLogger("titan_exp")


def _timed(label: str, fn, *args):
    """fn(*args), its time in the log: which part of a calibration takes the time."""
    start = time.perf_counter()
    out = fn(*args)
    logger.info("calibration: %s took %.1f s", label, time.perf_counter() - start)
    return out


def _measure_blocks(profile: MachineProfile, shape: str, m: ModelConfig, seq_len: int, world: int, opts: Options,
                    device: torch.device) -> None:
    """Time the model's block at every TP degree (and under CP and FSDP) into profile.blocks[shape]:
    what a CPU's step is predicted from."""
    # Compute is measured with every rank computing at once, as in a data-parallel step; the
    # model scales it for layouts where fewer ranks compute at a time (pipeline bubbles), by
    # `concurrency`, so a noisy concurrency only touches those.
    # A block inside the real model costs more than by itself (memory traffic, autograd across
    # blocks): one factor, from tp = 1 (measure_compute), scales every block's compute.
    plain, real, ratio = _timed("blocks", measure_compute, m, seq_len, world, opts, device)
    in_situ = min(3.0, max(1.0, ratio))  # below 1 taken as noise (0.78 for the debug model at world 8)
    cp_blocks = _timed("CP blocks", measure_cp_blocks, m, seq_len, world, opts, device)
    fsdp_blocks = _timed("FSDP blocks", measure_fsdp_blocks, m, seq_len, world, opts, device)
    profile.blocks[shape] = {}
    for tp, (fwd, fwd_bwd) in plain.items():
        in_situ_block, one, updates = real[tp]
        fwd, fwd_bwd = (Line(x.latency_s * in_situ, x.per_unit_s * in_situ) for x in (fwd, fwd_bwd))
        # The block as the real model at this tp computes it: an MoE block's routed experts are
        # measured whole (sharded_block), where a TP rank runs 1/tp of their work; the step
        # model takes the block at that share of its FLOPs (perf.model.step), and so does this.
        share = m.measured_block_share(tp)
        ran = Line(fwd_bwd.latency_s * share, fwd_bwd.per_unit_s * share)
        # The rest of the model: the 1-block model minus its block. What TP adds: the real TP
        # block (real_model_lines) minus its compute. Both floored at 0 (noise).
        rest = Line(max(0.0, one.latency_s - ran.latency_s), max(0.0, one.per_unit_s - ran.per_unit_s))
        tp_comm = Line(max(0.0, in_situ_block.latency_s - ran.latency_s),
                       max(0.0, in_situ_block.per_unit_s - ran.per_unit_s)) if tp > 1 else None
        # What CP adds: the real CP block on seq/cp positions minus the block on as many tokens.
        cp_extra = {cp: Line(max(0.0, line.latency_s - fwd_bwd.latency_s),
                             max(0.0, line.per_unit_s - fwd_bwd.per_unit_s / cp))
                    for cp, line in cp_blocks.items()} if tp == 1 else {}
        # What FSDP adds: the real FSDP block minus the block.
        fsdp_extra = {shard: Line(max(0.0, line.latency_s - fwd_bwd.latency_s),
                                  max(0.0, line.per_unit_s - fwd_bwd.per_unit_s))
                      for shard, line in fsdp_blocks.items()} if tp == 1 else {}
        profile.blocks[shape][tp] = BlockCost(fwd, fwd_bwd, rest, tp_comm=tp_comm, cp_extra=cp_extra,
                                              fsdp_extra=fsdp_extra, update=updates)
    profile.notes = [f"a block in the model costs {ratio:.2f}x the block by itself (tp 1): {in_situ:.2f}x used"]


def calibrate(job: JobConfig, opts: Options, device: torch.device, folder: Path | None) -> tuple[MachineProfile, bool]:
    """(profile, whether anything was measured)."""
    world = dist.get_world_size()
    cuda = device.type == "cuda"
    dev_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    # this_machine's key on a GPU; on a CPU the threads this rank was given, over gloo
    backend, threads = rank_key(True, world) if cuda else (dist.get_backend(), torch.get_num_threads())
    shape = model_shape(job)
    m, seq_len = job.model, job.training.seq_len
    nodes = job.cluster.nodes_for(world)
    known = find(dev_name, backend, world, threads, folder, nodes)
    if known is not None and known.source != "calibrated":
        known = None  # the defaults, refit by an autotune sweep: nothing measured to keep
    if known is not None and not opts.refresh and not known.missing(job, [], compile=opts.compile) and \
            (cuda or shape in known.blocks):
        return known, False
    start = time.perf_counter()
    keep_machine = known is not None and not opts.refresh  # a new model on a known machine: its blocks only
    if keep_machine:
        profile = dataclasses.replace(known, blocks=dict(known.blocks))
    else:
        profile = MachineProfile(key=machine_key(dev_name, backend, world, threads, nodes))
        profile.blocks = {k: v for k, v in (known.blocks if known else {}).items() if k != shape}  # other models'
        profile.concurrency = _timed("concurrency", concurrency, m, seq_len, world, opts, device)
    if cuda:  # a GPU's block is priced from its parts (perf.model.block), at the kernel rates measured below
        profile.notes = ["blocks not timed: a GPU's are priced from their parts at its kernels' rates"]
    else:
        _measure_blocks(profile, shape, m, seq_len, world, opts, device)
    gemm, tables = _timed("GEMMs", measure_gemms, m, seq_len, opts, device)
    profile.gemm.update(gemm)
    profile.gemm_shapes.update(tables)
    if not keep_machine:
        collectives = measure_collectives(world, opts, device, nodes) if world > 1 else ({}, {})
        profile.collectives, profile.inter_node = collectives
        profile.overlap = measure_overlap(world, opts, device) if world > 1 else 0.0
        profile.optimizer_s_per_param = _timed("optimizer", measure_optimizer, m, opts, device)
        profile.fresh_memory_s_per_byte = _timed("fresh memory", measure_fresh_memory, opts, device)
        profile.kernels = _timed("kernels", measure_kernels, m, opts, device)
        profile.step_overhead_s = 1e-3 if device.type == "cuda" else 5e-3  # refit from real runs
    if opts.compile:
        if not cuda:
            profile.compile_speedup = _timed("compile", measure_compile, m, seq_len, opts, device)
        if profile.kernels and "host_compiled_s" not in profile.kernels.measured:
            k = profile.kernels
            host_s = _timed("compiled host cost", host_compiled_s, opts, device)
            profile.kernels = dataclasses.replace(k, host_compiled_s=host_s,
                                                  measured=(*k.measured, "host_compiled_s"))
    if profile.kernels and "host_float8_s" not in profile.kernels.measured and \
            job.precision.converter == "float8" and not opts.compile:
        k = profile.kernels
        python_s = _timed("eager float8 host cost", host_float8_s, k.host_eager_s, opts, device)
        if python_s is not None:
            profile.kernels = dataclasses.replace(k, host_float8_s=python_s, measured=(*k.measured, "host_float8_s"))
    profile.created = time.strftime("%Y-%m-%dT%H:%M:%S")
    profile.calibration_s += time.perf_counter() - start
    return profile, True


def main(path: str) -> int:
    run_dir = RunDir(path)
    rank = int(os.environ.get("RANK", 0))
    setup_logging(run_dir, rank)
    job = load_job_config(run_dir.config)
    opts = Options(**json.loads((run_dir.path / "calibrate.json").read_text()))
    summary = RunSummary.of(job, Status.running, run_dir.path, slurm_job_id=slurm_job_id())
    start = time.time()
    try:
        device = init_distributed(job.comm.init_timeout_seconds)
        torch.manual_seed(0)
        folder = Path(opts.profile_dir) if opts.profile_dir else None
        profile, measured = calibrate(job, opts, device, folder)
        if rank == 0:
            out = profile.save(folder) if measured else profile.path(folder)
            logger.info("%s machine profile %s", "wrote" if measured else "reusing (--refresh remeasures)", out)
            summary = summary.replace(status=Status.ok, machine_profile=str(out))
        dist.barrier()
        return 0
    except BaseException as exc:  # noqa: BLE001 - the summary says why
        summary = summary.replace(status=Status.failed, error=f"{type(exc).__name__}: {exc}")
        logger.exception("calibration failed on rank %d", rank)
        raise
    finally:
        if rank == 0:
            run_dir.write_summary(summary.replace(wall_time_s=time.time() - start))
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
