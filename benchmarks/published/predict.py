"""A published row planned and predicted: its job validated as the launcher would (plan_rows),
its GPUs' spec-sheet profile, and its tokens/s (or MFU, or TFLOP/s) as its source's engine ran it."""

from __future__ import annotations

import dataclasses
import functools

from titan_exp.models.llama import flops_per_token
from titan_exp.perf.model.engine import Engine
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.devices import SPECS, DeviceSpec, Efficiency, spec_profile
from titan_exp.perf.rates.profile import MachineProfile
from titan_exp.validation import resolve, validate

from .engines import ENGINES, elementwise
from .jobs import GPUS, gpus_per_node, job_for, skip_reason
from .megatron import output_heads
from .rows import Planned, Row, published, recipe


def engine_for(row: Row) -> Engine:
    """The engine the row's source ran, with the model's memory-bound kernels, its output heads and
    its recipe's EP overlap."""
    return dataclasses.replace(ENGINES[row.source].engine, elementwise=elementwise(row),
                               output_heads=output_heads(row["model"]), ep_overlap=ep_overlapped(row))


def ep_overlapped(row: Row) -> bool:
    """Whether `row`'s recipe overlaps EP's all-to-alls with another microbatch's compute
    (overlap_moe_expert_parallel_comm, perf.model.overlap.ep_exposed) with a dispatch that never waits
    for the host: its step one CUDA graph (cuda_graph_impl full_iteration, from v0.5.0), which
    holds no host sync, each expert rank padded to a fixed capacity (moe_expert_rank_capacity_factor).
    A dropless dispatch sizes its buffers by token counts the host reads back, which drains the
    queue the overlap runs from (the earlier releases' rows that set it: RECIPE_GROUPS). Megatron-
    Bridge's comm-overlap check refuses the overlap under PP without virtual stages."""
    rec = recipe(row)
    return bool(rec and rec["moe_a2a_overlap"].startswith("true")
                and rec["cuda_graph_impl"].startswith("full_iteration")
                and int(row.num("ep", 1)) > 1 and (int(row.num("pp", 1)) == 1 or int(row.num("vp", 1)) > 1))


def plan_rows(rows: list[Row]) -> list[Planned]:
    out = []
    for row in rows:
        why = skip_reason(row)
        job = None
        if why is None:
            try:
                job = job_for(row)
                errors = validate(job, cuda=True)
                why = "refused: " + "; ".join(errors) if errors else None
                job = resolve(job) if not errors else None
            except (ValueError, KeyError, TypeError, ZeroDivisionError) as e:
                why, job = f"not built: {e}", None
        out.append(Planned(row, job, why))
    return out


# Cached here, not in perf.rates.devices: a MachineProfile is mutable (calibration fills it).
_spec_profile = functools.cache(spec_profile)


def machine(spec: DeviceSpec, gpus: int, per_node: int, eff: Efficiency, attention: str | None) -> MachineProfile:
    """spec_profile's profile, its collective tables built once a machine: a fit tries many
    compute_scales, which enters the profile as its compute correction alone."""
    base = _spec_profile(spec, gpus, per_node, dataclasses.replace(eff, compute_scale=1.0), attention)
    return dataclasses.replace(base, corrections=dataclasses.replace(base.corrections, compute=eff.compute_scale))


def predict(p: Planned, eff: Efficiency, host_cpu: str | None = None) -> float:
    """The prediction in the unit the row publishes (with its GPUs on another `host_cpu` if given:
    host_check)."""
    row, job = p.row, p.job
    gpus = int(row.num("gpus"))
    spec = SPECS[GPUS[row["gpu"]]]
    spec = dataclasses.replace(spec, host_cpu=host_cpu) if host_cpu else spec
    attention = ENGINES[row.source].kernel(spec.architecture)
    tps = predict_step(job, machine(spec, gpus, gpus_per_node(row), eff, attention), cuda=True,
                       engine=engine_for(row)).tokens_per_s_per_device
    unit, _ = published(row)
    if unit == "tokens/s":
        return tps
    tflops = tps * flops_per_token(job.model, job.training.seq_len) / 1e12
    return tflops / spec.bf16_tflops if unit == "mfu" else tflops
