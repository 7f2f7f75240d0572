"""A job's predicted step and memory on the GPUs its hardware file describes (`cluster.hardware`):
what the launcher logs before the ranks start and what a dry run reports."""

from __future__ import annotations

from typing import Any

from titan_exp.config import JobConfig
from titan_exp.perf.model.memory import GpuMemory, predict_memory
from titan_exp.perf.model.step import predict_step
from titan_exp.perf.rates.hardware import Hardware, memory_gib, profile


def prediction(job: JobConfig, hardware: Hardware, *, pp_rank: int | None = None) -> dict[str, Any]:
    """The job's predicted step and peak memory per device (of the ranks at pipeline position
    `pp_rank`, default the most loaded) on the file's GPUs, and the file's line."""
    step = predict_step(job, profile(job, hardware), cuda=True)
    gpu = GpuMemory(architecture=hardware.spec.architecture)  # cuBLAS's workspace size
    memory = predict_memory(job, cuda=True, pp_rank=pp_rank, gpu=gpu)["total"]
    device = memory_gib(job, hardware)
    return {"hardware": hardware.line(), "device": hardware.spec.name, "step_s": step.step_s,
            "tokens_per_s_per_device": step.tokens_per_s_per_device, "breakdown_s": step.breakdown(),
            "memory_gib": memory, "device_memory_gib": device, "fits": memory <= device}


def prediction_line(p: dict[str, Any]) -> str:
    """One line: what `prediction` says."""
    b = p["breakdown_s"]
    return (f"predicted on {p['device']} (cluster.hardware): {p['step_s']:.4g} s/step (compute {b['compute']:.3g}, "
            f"exposed comm {b['exposed_comm']:.3g}, bubble {b['bubble']:.3g}, recompute {b['recompute']:.3g}), "
            f"{p['tokens_per_s_per_device']:,.0f} tokens/s/device; {p['memory_gib']:.2f} GiB per device of its "
            f"{p['device_memory_gib']:.2f} GiB ({'fits' if p['fits'] else 'DOES NOT FIT'})")
