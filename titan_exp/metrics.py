"""Throughput, MFU, memory, and the sinks that record them (console, JSONL, TensorBoard, wandb)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch

from titan_exp import extras
from titan_exp.cache import cache_dir
from titan_exp.config import JobConfig, problem, to_plain
from titan_exp.files import atomic_write

logger = logging.getLogger("titan_exp")


def check(job: JobConfig, cuda: bool) -> list[str]:
    e: list[str] = []
    m = job.metrics
    if m.warmup_steps < 0:
        e.append(problem("metrics.warmup_steps", m.warmup_steps, "must be >= 0"))
    if m.peak_tflops is not None and not m.peak_tflops > 0:
        e.append(problem("metrics.peak_tflops", m.peak_tflops, "must be > 0, or null to measure/look up"))
    for on, module in ((m.enable_wandb, "wandb"), (m.enable_tensorboard, "tensorboard")):
        if on and (why := extras.missing(module)):
            e.append(problem(f"metrics.enable_{module}", True, f"{why}; or set it to false"))
    return e


# Dense peak TFLOP/s per GPU by name fragment (bf16 tensor cores, no sparsity).
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "L40S": 362.0, "A10G": 125.0}


def peak_matrix_size(flops_per_s: float, budget_s: float, reps: int, largest: int = 2048) -> int:
    """The square matmul size whose reps (and one warm-up) fit in budget_s at a rate seen on a small
    one: `largest` where the dtype is fast, smaller where it is slow here (bf16 on a CPU without
    AVX512-BF16 or AMX runs near 1 GFLOP/s, where 2048² takes 17 s a product)."""
    fits = (flops_per_s * budget_s / (reps + 1) / 2) ** (1 / 3)
    return max(256, min(largest, int(fits) // 64 * 64))


def measure_cpu_peak_tflops(dtype: torch.dtype, n: int = 2048, reps: int = 5, budget_s: float = 3.0) -> float:
    """Best observed `torch.mm` rate at this process's thread count: the ceiling MFU is read against.
    Products of n² (smaller where this dtype is slow here, so it costs about budget_s at most)."""
    def seconds(a: torch.Tensor, b: torch.Tensor) -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - start

    probe = torch.randn(256, 256, dtype=dtype)
    torch.mm(probe, probe)
    n = peak_matrix_size(2 * 256**3 / seconds(probe, probe), budget_s, reps, largest=n)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    return 2 * n**3 / min(seconds(a, b) for _ in range(reps)) / 1e12


# A launch measures the CPU's matmul peak (1-3 s before any rank starts) until the cache holds this
# many measurements for the machine, thread count and dtype, and then once a day; in between it
# reads the best of them.
PEAK_SAMPLES = 3
PEAK_REFRESH_S = 24 * 3600.0


def best_cpu_peak_tflops(dtype: torch.dtype) -> float:
    """The highest matmul rate this machine has shown at this thread count. A peak is a
    ceiling and noise only ever lowers a measurement, so the best one seen (kept in the cache)
    is the most honest denominator; on a shared VM single measurements vary by 2x."""
    path = cache_dir() / "cpu_peak.json"
    key = f"{platform.machine()}-{os.cpu_count()}cpu-{torch.get_num_threads()}threads-{dtype}"
    known = json.loads(path.read_text()) if path.exists() else {}
    seen = known.get(key)
    if not isinstance(seen, dict):  # none yet, or a best kept before the count was (one measurement)
        seen = {"tflops": seen or 0.0, "samples": 1 if seen else 0, "measured_at": 0.0}
    if seen["samples"] < PEAK_SAMPLES or time.time() - seen["measured_at"] > PEAK_REFRESH_S:
        seen = {"tflops": max(measure_cpu_peak_tflops(dtype), seen["tflops"]), "samples": seen["samples"] + 1,
                "measured_at": time.time()}
        known[key] = seen
        atomic_write(path, json.dumps(known, indent=1))
    return seen["tflops"]


def peak_tflops(job: JobConfig, device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(per-device peak, where it came from): the config (set by the user, or by the launcher's
    CPU measurement), the GPU table, or a measurement by this rank."""
    if job.metrics.peak_tflops is not None:
        return job.metrics.peak_tflops, "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"table ({name})"
        logger.warning("no peak FLOP/s known for %s; set metrics.peak_tflops for MFU", name)
        return float("nan"), f"unknown ({name})"
    return measure_cpu_peak_tflops(dtype), f"measured torch.mm {dtype} on {torch.get_num_threads()} thread(s)"


def peak_memory_gib(device: torch.device) -> float:
    """On a GPU the most the caching allocator held (reserved): what an out-of-memory error is
    about, what TorchTitan reports, and what the planner predicts (perf.model.memory.predict_memory). On a
    CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def peak_allocated_gib(device: torch.device) -> float | None:
    """On a GPU the most memory tensors held at once (max_memory_allocated): reserved less the
    allocator's cached and fragmented blocks. None on a CPU, which has no such allocator."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def local_bytes(tensors) -> int:
    """Bytes this rank holds for these tensors (its shard of a DTensor)."""
    from torch.distributed.tensor import DTensor  # a rank's import: the launcher's path does not pay it

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def state_bytes_by_kind(params: list[torch.Tensor], optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state held by this rank."""
    opt_state = [v for o in optimizers for state in o.state.values() for v in state.values() if torch.is_tensor(v)]
    grads = [p.grad for p in params if p.grad is not None]
    return {"params": local_bytes(params), "grads": local_bytes(grads), "optimizer": local_bytes(opt_state)}


def state_bytes(params: list[torch.Tensor], optimizers: list[torch.optim.Optimizer]) -> int:
    """Parameters + gradients + optimizer state held by this rank."""
    return sum(state_bytes_by_kind(params, optimizers).values())


class StepHistory:
    """Each step's loss, gradient norm and time, held on the device until the host needs them.

    Reading a GPU value (`.item()`) makes the host wait for the device, and a host that waits
    every step cannot queue step n+1 while step n runs. So the trainer adds each step's tensors
    here and reads them only where a value is needed: log, validation and checkpoint steps, the
    first and last steps, a stop, and every step with training.on_nonfinite=skip (which decides
    before each update). TorchTitan reads on log steps too. Step times come from CUDA events on a
    GPU (read with the values, so timing adds no wait) and from the host clock on CPU, where the
    host does the work itself."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.step_times: list[float] = []
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor, object, object]] = []
        self._start: object = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The step begun at `start()` has ended (on the host; on a GPU maybe not yet on the device)."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        else:
            end = time.perf_counter()
        self._pending.append((step, loss.detach(), grad_norm.detach(), self._start, end))

    @property
    def unread(self) -> bool:
        return bool(self._pending)

    def read(self) -> list[tuple[int, float, float, float]]:
        """(step, loss, grad norm, seconds) of each step added since the last read: one host read."""
        if not self._pending:
            return []
        values = torch.stack([torch.stack([loss.float(), norm.float()])
                              for _, loss, norm, _, _ in self._pending]).tolist()
        out = []
        for (step, _, _, start, end), (loss, norm) in zip(self._pending, values):
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out.append((step, loss, norm, seconds))
            self.losses.append(loss)
            self.grad_norms.append(norm)
            self.step_times.append(seconds)
        self._pending.clear()
        return out


class Throughput:
    """Tokens/s per device and MFU over the steps since the last report, and in steady state for
    the summary: every step this process trained after its first `warmup_steps` (compile, allocator
    and cache warm-up; a resumed or elastic segment warms up again)."""

    def __init__(self, flops_per_token: int, peak_tflops: float, world_size: int, warmup_steps: int):
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops * 1e12
        self.world_size = world_size
        self.warmup_steps = warmup_steps
        self._window_tokens = 0
        self._window_time = 0.0
        self._steps: list[tuple[int, float]] = []  # (tokens, seconds) of every step, in order

    def record(self, tokens: int, seconds: float) -> None:
        self._window_tokens += tokens
        self._window_time += seconds
        self._steps.append((tokens, seconds))

    def _rates(self, tokens: int, seconds: float) -> dict[str, float]:
        tps = tokens / seconds / self.world_size if seconds > 0 else float("nan")
        return {"tps_per_device": tps, "mfu": 100 * tps * self.flops_per_token / self.peak}

    def window(self) -> dict[str, float]:
        out = self._rates(self._window_tokens, self._window_time)
        self._window_tokens, self._window_time = 0, 0.0
        return out

    def steady(self) -> dict[str, float]:
        """The steady steps' rates (for a run too short to have any, every step's): `tps_per_device`
        and `mfu` of the median step, which one slow step (a checkpoint, validation, a stall) does
        not move; `tps_per_device_mean` and `mfu_mean`, all their tokens over all their time."""
        steps = self._steps[self.warmup_steps:] or self._steps
        rates = [tokens / seconds for tokens, seconds in steps if seconds > 0]
        median = self._rates(statistics.median(rates), 1.0) if rates else self._rates(0, 0.0)
        mean = self._rates(sum(t for t, _ in steps), sum(s for _, s in steps))
        return {**median, "tps_per_device_mean": mean["tps_per_device"], "mfu_mean": mean["mfu"]}


def wandb_run_id(run_dir: Path) -> str:
    """One tracked run per training run. The id comes from the run dir, which a requeued SLURM
    job keeps (as it keeps its job id), and which a relaunch that resumes a cancelled or killed
    run also keeps, while a new job id would start a second tracked run for the same training."""
    return "titan-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def wandb_logged_in() -> bool:
    """Whether wandb has credentials here: WANDB_API_KEY, or its entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_init_args(job: JobConfig, run_dir: Path) -> dict:
    """wandb.init's arguments: the config's wandb_* fields where set, else what wandb's own
    WANDB_* variables say (by leaving the argument out), else titan_exp's defaults. One run per
    run dir (`id`), so a requeued or resumed run continues it."""
    m = job.metrics
    args = {"dir": str(run_dir), "id": wandb_run_id(run_dir), "resume": "allow", "config": to_plain(job)}
    for key, value, env, default in (("entity", m.wandb_entity, "WANDB_ENTITY", None),
                                     ("project", m.wandb_project, "WANDB_PROJECT", "titan_exp"),
                                     ("group", m.wandb_group, "WANDB_RUN_GROUP", None),
                                     ("name", m.wandb_name, "WANDB_NAME", Path(run_dir).name)):
        value = value or (None if os.environ.get(env) else default)
        if value:
            args[key] = value
    if m.wandb_tags:
        args["tags"] = list(m.wandb_tags)
    if m.wandb_mode is not None:
        args["mode"] = m.wandb_mode.value
    elif not os.environ.get("WANDB_MODE") and not wandb_logged_in():
        args["mode"] = "offline"  # no credentials: online would stop at a login prompt
    return args


def sweep_member_tracking(job: JobConfig, sweep_dir: str, overrides_name: str) -> JobConfig:
    """A sweep member's wandb group (the sweep) and name (its overrides), unless the config or
    wandb's environment names them."""
    import dataclasses

    m = job.metrics
    group = m.wandb_group or (None if os.environ.get("WANDB_RUN_GROUP") else str(sweep_dir).strip("/"))
    name = m.wandb_name or (None if os.environ.get("WANDB_NAME") else overrides_name or None)
    return dataclasses.replace(job, metrics=dataclasses.replace(m, wandb_group=group, wandb_name=name))


class MetricSinks:
    """Every enabled sink behind one `log(step, metrics)`; only rank 0 writes."""

    def __init__(self, job: JobConfig, run_dir: Path, rank: int):
        self.active = rank == 0
        self.jsonl = self.tb = self.wandb_run = None
        if not self.active:
            return
        self.jsonl = open(run_dir / "metrics.jsonl", "a")
        if job.metrics.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        if job.metrics.enable_wandb:
            import wandb

            self.wandb_run = wandb.init(**wandb_init_args(job, run_dir))
            if job.eval.enable:  # evaluations arrive steps after their own: wandb plots them by eval/step
                self._wandb("define_metric", "eval/*", step_metric="eval/step")
        self.step = 0  # the latest step logged

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        self.step = step
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
        self._wandb("log", metrics, step=step)
        logger.info(
            "step %4d | loss %.4f | grad_norm %.3f | lr %.2e | tps/device %8.1f | mfu %5.1f%% | mem %.2f GiB%s",
            step, metrics["loss"], metrics["grad_norm"], metrics["lr"],
            metrics["tps_per_device"], metrics["mfu"], metrics["peak_memory_gib"],
            f" | val_loss {metrics['val_loss']:.4f} | val_ppl {metrics['val_perplexity']:.1f}"
            if "val_loss" in metrics else "",
        )

    def log_eval(self, step: int, results: dict[str, dict[str, float]]) -> None:
        """An evaluation of the model at `step` ({task: {metric: value}}, titan_exp.eval), which
        finishes steps later: metrics.jsonl gets {"step": step, "eval": results}, TensorBoard and
        wandb each `eval/<task>/<metric>` (wandb at its latest step, with eval/step beside)."""
        if not self.active:
            return
        self.jsonl.write(json.dumps({"step": step, "eval": results}) + "\n")
        self.jsonl.flush()
        flat = {f"eval/{task}/{metric}": value for task, row in results.items() for metric, value in row.items()}
        if self.tb is not None:
            for key, value in flat.items():
                self.tb.add_scalar(key, value, step)
        self._wandb("log", {**flat, "eval/step": step}, step=max(step, self.step))
        logger.info("step %4d | eval %s", step,
                    " | ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in flat.items()))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        self._wandb("finish")

    def _wandb(self, method: str, *args, **kwargs) -> None:
        """A call into wandb that cannot end the run: if wandb's service process is gone (SLURM
        signals every process of a job step, so a preemption's SIGTERM reaches it too), tracking
        stops for this segment with a warning; metrics.jsonl has every step, and a resumed run
        continues the same wandb run (wandb_run_id)."""
        if self.wandb_run is None:
            return
        try:
            getattr(self.wandb_run, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any wandb failure
            logger.warning("wandb %s failed (%s: %s); wandb logging stops for this run segment",
                           method, type(exc).__name__, exc)
            self.wandb_run = None
