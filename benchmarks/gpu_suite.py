"""Everything that needs CUDA, for one H100/H200 (a model's rows take 8-12 min there; --configs and
--budget-minutes cut a call to a time slot):

    python -m benchmarks.gpu_suite [--models llama3_1b llama3_3b] [--out DIR]
    python -m benchmarks.gpu_suite --models llama3_3b --configs "bf16 + compile" --budget-minutes 8
    python -m benchmarks.gpu_suite --smoke --out DIR     # the same code on CPU, a tiny model (tests, -m slow)

1. the CUDA-only tests (`pytest -m cuda`);
2. per model: tokens/s, MFU and peak memory for bf16 eager and + compile, float8 tensorwise and
   rowwise (+ compile), activation checkpointing none / selective / full, and MXFP8 where the
   device has MX matmuls (compute capability >= 10.0; on Hopper the row says why it is skipped);
3. the planner's predicted peak memory and step time next to each measurement
   (`titan_exp.perf.model.memory.predict_memory`, `titan_exp.perf.model.step.predict_step` on a profile the
   suite calibrates first: `python -m titan_exp.perf.calibrate <model> --world 1 --compile`);
4. compile cold vs warm: the bf16 + compile run again, on the cache the first one filled;
5. what reading losses from the device every step costs: bf16 + compile with metrics.log_freq=1
   (a host read, hence a device sync, every step) against the default, which reads only on log
   steps (`titan_exp.metrics.StepHistory`);
6. bf16 and float8 + compile with one step traced by torch.profiler: where the GPU waited, its
   kernels and the longest ones (`titan_exp.train.trace.gpu_summary`); the traces are kept
   gzipped beside the table;
7. float8 and bf16 + compile under Inductor settings (INDUCTOR_ENV, environment variables the
   rank processes read), for the kernel that keeps float8 short of issue 37's 1.25x.

Rows are written to the JSON as they finish, so a run stopped from outside keeps what it measured;
with --budget-minutes no row starts after that time (the rest say so). The GPU's profile lands
in DIR too, and with --no-calibrate the rows are predicted from the one in TITAN_EXP_CACHE.

It writes DIR/gpu_suite.md (one table) and DIR/gpu_suite.json. Each configuration runs as a real
launch (`titan_exp.launch`): one rank process per run on a GPU, so that peak memory is that run's
own. --smoke runs the same configurations and the same collection, tables and checks through the
in-process executor (cluster=debug) and compiles with the aot_eager backend (dynamo and AOTAutograd
without inductor's C++ builds), so CI exercises the suite in about a minute and it cannot rot.
MFU is left out for float8/MX rows, as TorchTitan does: their peak is a different number.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from benchmarks.common import REPO, run_job
from titan_exp.config import compose_job
from titan_exp.train.trace import latest_trace

COMPILE = ["compile.enable=true"]
# Most telling first: with --budget-minutes the suite stops before a row it could not finish.
CONFIGS = {
    "bf16 + compile": ["precision=bf16", *COMPILE],
    "float8 tensorwise + compile": ["precision=float8", *COMPILE],
    "bf16 eager": ["precision=bf16"],
    "float8 rowwise + compile": ["precision=float8_rowwise", *COMPILE],
    "float8 tensorwise": ["precision=float8"],
    "float8 rowwise": ["precision=float8_rowwise"],
    "bf16 + compile, AC selective": ["precision=bf16", *COMPILE, "activation_checkpoint.mode=selective"],
    "bf16 + compile, AC full": ["precision=bf16", *COMPILE, "activation_checkpoint.mode=full"],
    # Eager full AC: its loss (7 bf16 logits' worth, perf.model.memory_gpu.LOSS_UNITS) and the block it
    # recomputes, alive at once or not (BENCHMARKS.md, the planner against TorchTitan: tried, not
    # kept 2026-12-02): the allocated peak differs by the block, about 4 % on the 1B.
    "bf16 eager, AC full": ["precision=bf16", "activation_checkpoint.mode=full"],
    "bf16 + compile, read every step": ["precision=bf16", *COMPILE, "metrics.log_freq=1"],
    # The model's blocks as MoE layers, 8 experts of width 1024, top 2: torch._grouped_mm on CUDA.
    "MoE 8 experts top-2, bf16 + compile": ["precision=bf16", *COMPILE, "model.n_experts=8", "model.top_k=2",
                                            "model.moe_hidden_dim=1024"],
    "mxfp8": ["precision=mxfp8", "precision.mx_recipe=mxfp8_rceil"],
    # A torch.profiler trace of one step (titan_exp.train.trace.gpu_summary): where the GPU waited.
    "bf16 + compile, traced": ["precision=bf16", *COMPILE, "profiling.enable_profiling=true"],
    "float8 tensorwise + compile, traced": ["precision=float8", *COMPILE, "profiling.enable_profiling=true"],
    # What the 1B's grid on the H200 (2026-11-27) measured furthest from its prediction: eager
    # selective AC 26-38 % slow, rowwise float8 + compile 10-27 %.
    "bf16 eager, AC selective, traced": ["precision=bf16", "activation_checkpoint.mode=selective",
                                         "profiling.enable_profiling=true"],
    "float8 rowwise + compile, traced": ["precision=float8_rowwise", *COMPILE, "profiling.enable_profiling=true"],
    # Eager bf16 under autocast, whose casts and fp32 residual stream were priced after the 8B's
    # grid (2026-11-28), and eager float8, 15-23 % slower than priced there: traced held out that day.
    "bf16 eager, traced": ["precision=bf16", "profiling.enable_profiling=true"],
    "float8 tensorwise, traced": ["precision=float8", "profiling.enable_profiling=true"],
    # Compiled float8 under AC costs 8-14 points less over no AC than priced on all four H200 grids
    # (full AC +9-14 %, priced +21-25 %; selective -1 to +5 %, priced +11-14 %): what its recompute runs.
    "float8 tensorwise + compile, AC full, traced": ["precision=float8", *COMPILE, "activation_checkpoint.mode=full",
                                                     "profiling.enable_profiling=true"],
    # torchao's float8 shape filter (TorchTitan's auto_filter_small_kn), added 2026-11-28: on the 1B
    # rowwise keeps all but w1 and w3 in bf16, which torchao's H100 tables find faster there.
    "float8 rowwise + compile, small linears bf16": ["precision=float8_rowwise", *COMPILE,
                                                     "precision.filter_fqns=[output,auto_filter_small_kn]"],
    "float8 tensorwise + compile, small linears bf16": ["precision=float8", *COMPILE,
                                                        "precision.filter_fqns=[output,auto_filter_small_kn]"],
}
# Rows that are another row under Inductor settings, as the environment variables
# torch/_inductor/config.py reads when a rank process imports torch (on a GPU every rank starts
# fresh; cluster.forkserver restarts its server when a TORCHINDUCTOR_ variable changes): float8 +
# compile for the norm backward's kernel that keeps it at 1.07-1.08x bf16 + compile on the H200's
# 3B (BENCHMARKS.md, issue 37's float8 target).
LOOPED, TUNED = {"TORCHINDUCTOR_PERSISTENT_REDUCTIONS": "0"}, {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}
INDUCTOR_ROWS = {  # name: (the row it reruns, its settings)
    "float8 tensorwise + compile, looped reductions": ("float8 tensorwise + compile", LOOPED),
    "float8 tensorwise + compile, coordinate descent": ("float8 tensorwise + compile", TUNED),
    "bf16 + compile, coordinate descent": ("bf16 + compile", TUNED),
}
CONFIGS |= {name: CONFIGS[base] for name, (base, _) in INDUCTOR_ROWS.items()}
INDUCTOR_ENV = {name: env for name, (_, env) in INDUCTOR_ROWS.items()}
TRACED = "traced"
# TorchTitan's sequence length, one sequence a step, AC none: what its Llama 3 tables run (one H200
# holds either model so).
SHAPES = {"llama3_1b": (1, 8192), "llama3_3b": (1, 8192)}
SMOKE_MODEL = ["model=debugmodel", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
               "model.multiple_of=32"]
TARGETS = {"mfu_bf16_compile": 50.0, "float8_speedup": 1.25, "memory_error_pct": 10.0}  # issue 37
FLAGS = ("training.steps", "metrics.", "compile.backend")  # run settings the calibration does not take


def skip_reason(name: str, cuda: bool) -> str | None:
    import torch

    if name == "mxfp8" and cuda and torch.cuda.get_device_capability() < (10, 0):
        return f"MX matmuls need compute capability >= 10.0 (Blackwell); this is {torch.cuda.get_device_name()}"
    return None  # (on CPU MXFP8 is emulated, so the smoke run still takes its code path)


def overrides_for(model: str, steps: int, smoke: bool) -> list[str]:
    if smoke:
        return [*SMOKE_MODEL, "training.local_batch_size=2", "training.seq_len=32", f"training.steps={steps}",
                "metrics.warmup_steps=1", f"metrics.log_freq={steps}", "cluster=debug", "compile.backend=aot_eager"]
    batch, seq = SHAPES[model]
    return [f"model={model}", f"training.local_batch_size={batch}", f"training.seq_len={seq}",
            f"training.steps={steps}", "metrics.warmup_steps=5", f"metrics.log_freq={steps}"]


def calibrate(base: list[str], smoke: bool, log: Path) -> str:
    """Measure this device for the performance model (one rank, the model's own shapes), so the
    step-time predictions below come from a calibrated profile; says how long it took, or why it
    failed (the rows then carry the uncalibrated defaults' predictions, and say so)."""
    overrides = [o for o in base if not o.startswith(FLAGS)]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.calibrate", *overrides, "--world", "1",
                          *(["--tiny"] if smoke else ["--compile"])], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    log.write_text(out.stdout + out.stderr)  # each part's time (titan_exp.perf.calibration.measure)
    if out.returncode:
        return f"calibration failed: {(out.stdout + out.stderr)[-1500:]}"
    return f"calibrated in {time.perf_counter() - start:.0f} s"


def spec_sheet(cuda: bool):
    """The spec-sheet profile of this GPU (titan_exp.perf.rates.devices), or None for a CPU or an
    unlisted GPU: the prediction a user gets before calibrating, shown beside the calibrated one."""
    import torch

    from titan_exp.perf.rates.devices import SPECS, spec_profile

    name = torch.cuda.get_device_name() if cuda else ""
    spec = next((s for s in SPECS.values() if any(n in name for n in s.cuda_names)), None)
    return spec_profile(spec, 1, 1) if spec else None


def predictions(overrides: list[str], cuda: bool) -> dict:
    """The planner's memory and step time for a configuration: from this machine's profile
    (calibrated above) and from the GPU's spec sheet."""
    from titan_exp.perf.model.memory import predict_memory
    from titan_exp.perf.model.step import gpu_work_by_kind, predict_step
    from titan_exp.perf.rates.profile import this_machine
    from titan_exp.validation import resolve

    job = resolve(compose_job(overrides))
    profile, spec = this_machine(1, cuda=cuda), spec_sheet(cuda)
    gpu_profile = profile if profile.kernels and profile.kernels.architecture != "cpu" else spec
    return {"tokens_per_step": job.training.global_batch_size * job.training.seq_len,
            "predicted_memory_gib": predict_memory(job, cuda=cuda)["total"],
            "predicted_step_s": predict_step(job, profile, cuda=cuda).step_s, "step_profile": profile.source,
            "spec_step_s": predict_step(job, spec, cuda=cuda).step_s if spec else None,
            # beside a trace's busy_by_kind_ms: what the plan prices each kind of device work at
            "predicted_by_kind_ms": ({k: round(v * 1e3, 3) for k, v in gpu_work_by_kind(job, gpu_profile).items()}
                                     if gpu_profile else None)}


def measure(name: str, overrides: list[str], run_dir: Path, cuda: bool) -> dict:
    """One configuration: its summary's numbers, and the planner's predictions beside them."""
    import torch

    from titan_exp.train.trace import gpu_summary, latest_trace

    if reason := skip_reason(name, cuda):
        return {"config": name, "status": "skipped", "reason": reason}
    torch._dynamo.reset()  # the in-process (smoke) runs must not reuse each other's compiled code
    start = time.perf_counter()
    env = INDUCTOR_ENV.get(name, {})
    with mock.patch.dict(os.environ, env):
        code, summary = run_job(overrides, run_dir)
    summary = summary or {"status": "failed", "error": "no summary"}
    wall = time.perf_counter() - start
    try:
        predicted = predictions(overrides, cuda)
    except Exception as exc:  # noqa: BLE001 - a planner bug must not lose the measurement
        predicted = {"prediction_error": f"{type(exc).__name__}: {exc}"[:300]}
    tps, measured = summary.get("tokens_per_second_per_device"), summary.get("peak_memory_gib")
    measured_step = predicted["tokens_per_step"] / tps if tps and "tokens_per_step" in predicted else None
    memory = predicted.get("predicted_memory_gib")
    trace = latest_trace(run_dir) if TRACED in name else None
    low_precision = "float8" in name or "mx" in name
    return {
        "config": name,
        "status": summary["status"],
        "env": env,
        "reason": (summary.get("error") or "")[:300],
        "tokens_per_second": tps,
        "mfu": None if low_precision else summary.get("mfu"),
        "peak_memory_gib": measured,
        "peak_allocated_gib": summary.get("peak_memory_allocated_gib"),
        **predicted,
        "memory_error_pct": 100 * (memory - measured) / measured if measured and memory else None,
        "step_s": measured_step,
        "compile_s": summary.get("compile_s"),
        "compile_cache": summary.get("compile_cache"),
        "final_loss": summary.get("final_loss"),
        "step_times_s": summary.get("step_times_s"),
        "trace": gpu_summary(trace) if trace else None,
        "wall_s": wall,
    }


def cuda_tests() -> dict:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return {"returncode": out.returncode, "summary": lines[-1] if lines else out.stderr[-300:]}


def checks(rows: list[dict], cuda: bool) -> list[str]:
    """The issue's targets, each said met or missed (on CPU, the smoke run only shows they compute)."""
    by = {r["config"]: r for r in rows if r["status"] == "ok"}
    lines = []
    if "bf16 + compile" in by and by["bf16 + compile"]["mfu"] is not None:
        mfu = by["bf16 + compile"]["mfu"]
        lines.append(f"bf16 + compile MFU {mfu:.1f} % (target >= {TARGETS['mfu_bf16_compile']:g} %): "
                     f"{'met' if mfu >= TARGETS['mfu_bf16_compile'] else 'missed'}")
    if "float8 tensorwise + compile" in by and "bf16 + compile" in by:
        ratio = by["float8 tensorwise + compile"]["tokens_per_second"] / by["bf16 + compile"]["tokens_per_second"]
        lines.append(f"float8 tensorwise + compile / bf16 + compile tokens/s = {ratio:.2f} "
                     f"(target >= {TARGETS['float8_speedup']}): "
                     f"{'met' if ratio >= TARGETS['float8_speedup'] else 'missed'}")
    if "bf16 + compile, read every step" in by and "bf16 + compile" in by:
        ratio = by["bf16 + compile"]["tokens_per_second"] / by["bf16 + compile, read every step"]["tokens_per_second"]
        lines.append(f"reading the loss only on log steps / every step: tokens/s x {ratio:.3f}")
    timed = [r for name, r in by.items() if r.get("step_s") and TRACED not in name]  # a trace slows its step
    for key, label in (("predicted_step_s", f"{timed[0].get('step_profile')} profile" if timed else ""),
                       ("spec_step_s", "spec sheet")):
        steps = sorted(abs(r[key] / r["step_s"] - 1) * 100 for r in timed if r.get(key))
        if steps:
            lines.append(f"planner step time ({label}): median |error| {steps[len(steps) // 2]:.0f} %, "
                         f"worst {steps[-1]:.0f} % over {len(steps)} runs")
    errors = [abs(r["memory_error_pct"]) for r in by.values() if r.get("memory_error_pct") is not None]
    if errors:
        worst = max(errors)
        lines.append(f"planner memory: worst |error| {worst:.1f} % over {len(errors)} runs (target <= "
                     f"{TARGETS['memory_error_pct']:g} %): "
                     f"{'met' if worst <= TARGETS['memory_error_pct'] else 'missed'}")
    if not cuda:
        lines.append("(smoke run on CPU: the numbers only show the suite computes them; targets are for a GPU)")
    return lines


def fmt(value, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def to_markdown(results: dict) -> str:
    lines = [f"GPU suite on {results['device']} ({'smoke' if results['smoke'] else 'full'}), torch {results['torch']}, "
             f"{results['date']}", "", f"CUDA-only tests: {results['cuda_tests']['summary']}", ""]
    for model, rows in results["models"].items():
        lines += [f"### {model}", "",
                  "| config | status | tokens/s | MFU % | reserved GiB | allocated GiB | predicted GiB | error % "
                  "| step s | predicted s | spec-sheet s | compile s | reason |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append("| " + " | ".join([
                r["config"], r["status"], fmt(r.get("tokens_per_second")), fmt(r.get("mfu")),
                fmt(r.get("peak_memory_gib"), 2), fmt(r.get("peak_allocated_gib"), 2),
                fmt(r.get("predicted_memory_gib"), 2),
                fmt(r.get("memory_error_pct")), fmt(r.get("step_s"), 3), fmt(r.get("predicted_step_s"), 3),
                fmt(r.get("spec_step_s"), 3), fmt(r.get("compile_s")),
                (r.get("reason") or r.get("prediction_error") or "").replace("|", "/")]) + " |")
        lines += ["", f"- {results['calibration'][model]}"] + [f"- {line}" for line in results["checks"][model]]
        lines += [f"- trace of {r['config']}: {json.dumps(r['trace'])}; priced by kind (ms): "
                  f"{json.dumps(r.get('predicted_by_kind_ms'))}" for r in rows if r.get("trace")] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the same code paths on CPU with a tiny model")
    parser.add_argument("--models", nargs="+", default=["llama3_1b"], choices=sorted(SHAPES))
    parser.add_argument("--configs", nargs="+", default=None, choices=[*CONFIGS, "warm"],
                        help="only these rows (default: all, and the warm-cache rerun)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 30; smoke 3)")
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="start no row after this many minutes (the rows left say so)")
    parser.add_argument("--no-tests", action="store_true", help="leave out the CUDA-only tests")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="predict from the profile already in TITAN_EXP_CACHE (or the defaults) and the spec sheet")
    parser.add_argument("--out", type=Path, default=REPO / "gpu_suite")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("no CUDA device here; run with --smoke to exercise the suite on CPU")
    steps = args.steps or (3 if args.smoke else 30)
    models = ["smoke"] if args.smoke else args.models
    names = args.configs or [*CONFIGS, "warm"]
    deadline = time.monotonic() + 60 * args.budget_minutes if args.budget_minutes else float("inf")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if cuda else "CPU", "smoke": args.smoke,
               "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M"),
               "cuda_tests": {"summary": "not run"} if args.no_tests else cuda_tests(), "models": {}, "checks": {},
               "calibration": {}}

    def save() -> None:  # after every row, so a run stopped from outside keeps what it measured
        (args.out / "gpu_suite.json").write_text(json.dumps(results, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        profiles = Path(os.environ.get("TITAN_EXP_CACHE", "/nonexistent")) / "perf"
        if args.no_calibrate and profiles.is_dir():  # its profile (none on a fresh machine), and a fresh compile cache
            shutil.copytree(profiles, cache / "perf", dirs_exist_ok=True)
        os.environ["TITAN_EXP_CACHE"] = str(cache)  # compile starts cold
        for model in models:
            base = overrides_for(model, steps, args.smoke)
            results["calibration"][model] = "not calibrated (--no-calibrate)" if args.no_calibrate else \
                calibrate(base, args.smoke, args.out / f"calibrate_{model}.log")
            rows = results["models"][model] = []
            for i, name in enumerate(names):
                if time.monotonic() > deadline:
                    rows.append({"config": name, "status": "skipped", "reason": "over --budget-minutes"})
                    continue
                extra = CONFIGS["bf16 + compile" if name == "warm" else name]
                if TRACED in name:
                    extra = [*extra, f"profiling.profile_freq={max(2, steps - 2)}"]
                row = measure(name, [*base, *extra], Path(tmp) / model / str(i), cuda)
                if trace := latest_trace(Path(tmp) / model / str(i)):  # kept, for Perfetto
                    (args.out / f"trace_{model}_{i}.json.gz").write_bytes(gzip.compress(trace.read_bytes()))
                rows.append({**row, "config": "bf16 + compile, warm cache"} if name == "warm" else row)
                save()
            results["checks"][model] = checks(rows, cuda)
        for profile in (cache / "perf").glob("*.json"):  # the calibrated profile, kept beside the rows
            (args.out / f"profile_{re.sub(r'[^A-Za-z0-9._-]', '_', profile.name)}").write_text(profile.read_text())
    save()
    (args.out / "gpu_suite.md").write_text(to_markdown(results))
    print(to_markdown(results))
    failed = [r["config"] for rows in results["models"].values() for r in rows if r["status"] not in ("ok", "skipped")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or results["cuda_tests"].get("returncode") not in (None, 0, 5) else 0


if __name__ == "__main__":
    raise SystemExit(main())
