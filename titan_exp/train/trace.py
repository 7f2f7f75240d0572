"""A step's time split from a torch.profiler trace (profiling.enable_profiling).

On the thread that ran the step (the one with the `ProfilerStep#N` range), time inside
communication is exposed: the c10d ops that start collectives (`c10d::...`), the waits for
functional collectives (`_c10d_functional::wait_tensor`: DTensor's, which TP, SP and the loss
use, start asynchronously and are waited for where their result is needed) and the process
group's own waits (`gloo:...`, a blocking send, receive or collective). Point-to-point ones
(send/recv) are the pipeline's transfers and its bubble, which a trace cannot tell apart; the
rest is compute. Recomputation runs the same ops as the forward, so a trace does not separate it
either: the report takes it from the model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

COMM = re.compile(r"^(c10d::|_c10d_functional::|gloo:|nccl:)")
P2P = re.compile(r"send|recv", re.IGNORECASE)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def step_breakdown(trace: Path) -> dict[str, float] | None:
    """Seconds of the traced step: step_s, compute, exposed_comm, p2p_and_bubble; None if the
    file holds no profiler step."""
    events = [e for e in json.loads(Path(trace).read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        return None
    step = max(steps, key=lambda e: e["ts"])
    start, end, tid = step["ts"], step["ts"] + step["dur"], step["tid"]
    inside = [e for e in events if e["tid"] == tid and start <= e["ts"] < end and COMM.match(e["name"])]
    comm = [(e["ts"], min(end, e["ts"] + e["dur"])) for e in inside if not P2P.search(e["name"])]
    p2p = [(e["ts"], min(end, e["ts"] + e["dur"])) for e in inside if P2P.search(e["name"])]
    comm_s, p2p_s = _union(comm) / 1e6, _union(p2p) / 1e6
    step_s = step["dur"] / 1e6
    return {"step_s": step_s, "compute": max(0.0, step_s - comm_s - p2p_s), "exposed_comm": comm_s,
            "p2p_and_bubble": p2p_s}


def latest_trace(run_dir: Path, folder: str = "profile_traces", rank: int = 0) -> Path | None:
    """The last traced step's trace of `rank` in a run dir."""
    found = sorted((Path(run_dir) / folder).glob(f"iteration_*/rank{rank}_trace.json"),
                   key=lambda p: int(p.parent.name.split("_")[1]))
    return found[-1] if found else None


# -- one GPU's trace: where the device waited ---------------------------------------------------
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the host's calls that start device work (cuLaunchKernel: Triton's)
# The host waiting on the device. (aten::item alone is no sign: on a CPU tensor it waits for nothing.)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
# What kind of work a kernel is, by its name, in the parts perf.model.block prices a step by: matmuls
# (cuBLAS's nvjet and sm90 kernels, CUTLASS, Inductor's GEMM templates), attention (cuDNN's and
# FlashAttention's SDPA kernels), the optimizer phase (multi-tensor kernels: fused AdamW and the
# gradient norm's foreach reduction) and the memory-bound rest (elementwise, norms, casts, copies;
# every kernel Inductor generates but its templates, whatever ops its name lists).
KINDS = (("gemm", re.compile(r"^triton_tem_|nvjet|gemm|cutlass|xmma|^sm90_", re.IGNORECASE)),
         ("memory_bound", re.compile(r"^triton_")),
         ("attention", re.compile(r"sdpa|flash|fmha", re.IGNORECASE)),
         ("optimizer", re.compile(r"multi_tensor_apply")))


def kernel_kind(name: str) -> str:
    """gemm, attention, optimizer or memory_bound (KINDS)."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "memory_bound")


def gpu_summary(trace: Path, top: int = 8) -> dict | None:
    """What a GPU did for the traced step: the device work the step's host range launched (the
    last `ProfilerStep#N`; its kernels matched to their launches by correlation id, so that the
    previous step's optimizer kernels, still running when the step's range opens, are not counted
    again), the window from its first to its last kernel, the time some kernel ran (busy) and the
    rest (idle: the host was late, a sync, the data loader), the busy time by kind (KINDS), the
    kernel count, host waits on the device (syncs), compiled regions entered (more than the
    compiled modules' count means graph breaks) and the longest-running kernels. Without a step
    range, all device work in the file. None if the trace holds no device work."""
    events = [e for e in json.loads(Path(trace).read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    work = [e for e in events if e.get("cat") in DEVICE_WORK]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if steps:
        step = max(steps, key=lambda e: e["ts"])
        opened, closed = step["ts"], step["ts"] + step["dur"]
        launched = {e["args"]["correlation"] for e in events if e.get("cat") in LAUNCHES
                    and opened <= e["ts"] < closed and "correlation" in e.get("args", {})}
        work = [e for e in work if e.get("args", {}).get("correlation") in launched]
        events = [e for e in events if opened <= e["ts"] < closed]
    if not work:
        return None
    start, end = min(e["ts"] for e in work), max(e["ts"] + e["dur"] for e in work)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in work])
    by_name: dict[str, float] = {}
    by_kind = dict.fromkeys((kind for kind, _ in KINDS), 0.0)
    for e in work:
        by_name[e["name"][:80]] = by_name.get(e["name"][:80], 0.0) + e["dur"]
        by_kind[kernel_kind(e["name"])] += e["dur"]
    syncs = [e for e in events if e["name"] in SYNCS]
    ordered = sorted(work, key=lambda e: e["ts"])
    gaps = sorted((b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ordered, ordered[1:])), reverse=True)
    return {"window_s": (end - start) / 1e6, "busy_s": busy / 1e6, "idle_s": (end - start - busy) / 1e6,
            "busy_by_kind_ms": {k: round(v / 1e3, 3) for k, v in by_kind.items()},
            "kernels": sum(e.get("cat") == "kernel" for e in work),
            "host_to_device_copies": sum("HtoD" in e["name"] for e in work if e.get("cat") == "gpu_memcpy"),
            "syncs": len(syncs), "sync_s": sum(e["dur"] for e in syncs) / 1e6,
            "compiled_regions": sum(e["name"].startswith("Torch-Compiled Region") for e in events),
            "longest_gaps_ms": [round(g / 1e3, 3) for g in gaps[:5]],
            "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}}
