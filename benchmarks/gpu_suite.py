"""Everything that needs CUDA, in one command sized for one H100/H200 (each step well inside 10 min):

    python benchmarks/gpu_suite.py [--models llama3_1b llama3_3b] [--out DIR]
    python benchmarks/gpu_suite.py --smoke --out DIR     # the same code on CPU, a tiny model (CI)

1. the CUDA-only tests (`pytest -m cuda`);
2. per model: tokens/s, MFU and peak memory for bf16 eager and + compile, float8 tensorwise and
   rowwise (+ compile), activation checkpointing none / selective / full, and MXFP8 where the
   device has MX matmuls (compute capability >= 10.0; on Hopper the row says why it is skipped);
3. the planner's predicted peak memory and step time next to each measurement
   (`titan_exp.perf.memory.predict_memory`, `titan_exp.perf.step.predict_step` on a profile the
   suite calibrates first: `python -m titan_exp.perf.calibrate <model> --world 1 --compile`);
4. compile cold vs warm: the bf16 + compile run again, on the cache the first one filled;
5. what reading losses from the device every step costs: bf16 + compile with metrics.log_freq=1
   (a host read, hence a device sync, every step) against the default, which reads only on log
   steps (`titan_exp.metrics.StepHistory`).

It writes DIR/gpu_suite.md (one table) and DIR/gpu_suite.json. Each configuration runs as a real
launch (`titan_exp.launch`): one rank process per run on a GPU, so that peak memory is that run's
own. --smoke runs the same configurations and the same collection, tables and checks through the
in-process executor (cluster=debug) and compiles with the aot_eager backend (dynamo and AOTAutograd
without inductor's C++ builds), so CI exercises the suite in about a minute and it cannot rot.
MFU is left out for float8/MX rows, as TorchTitan does: their peak is a different number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the checkout's titan_exp, installed or not
from conftest import job_config, run_job  # noqa: E402

COMPILE = ["compile.enable=true"]
CONFIGS = {
    "bf16 eager": ["precision=bf16"],
    "bf16 + compile": ["precision=bf16", *COMPILE],
    "float8 tensorwise": ["precision=float8"],
    "float8 tensorwise + compile": ["precision=float8", *COMPILE],
    "float8 rowwise": ["precision=float8_rowwise"],
    "float8 rowwise + compile": ["precision=float8_rowwise", *COMPILE],
    "bf16 + compile, AC selective": ["precision=bf16", *COMPILE, "activation_checkpoint.mode=selective"],
    "bf16 + compile, AC full": ["precision=bf16", *COMPILE, "activation_checkpoint.mode=full"],
    "mxfp8": ["precision=mxfp8", "precision.mx_recipe=mxfp8_rceil"],
    "bf16 + compile, read every step": ["precision=bf16", *COMPILE, "metrics.log_freq=1"],
    # The model's blocks as MoE layers, 8 experts of width 1024, top 2: torch._grouped_mm on CUDA.
    "MoE 8 experts top-2, bf16 + compile": ["precision=bf16", *COMPILE, "model.n_experts=8", "model.top_k=2",
                                            "model.moe_hidden_dim=1024"],
}
# One sequence batch per model that fits one 80 GB GPU with room (AC none).
SHAPES = {"llama3_1b": (4, 2048), "llama3_3b": (2, 2048)}
SMOKE_MODEL = ["model=debugmodel", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
               "model.multiple_of=32"]
TARGETS = {"mfu_bf16_compile": 45.0, "float8_speedup": 1.2, "memory_error_pct": 10.0}
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


def calibrate(base: list[str], smoke: bool) -> str:
    """Measure this device for the performance model (one rank, the model's own shapes), so the
    step-time predictions below come from a calibrated profile; returns how long it took."""
    overrides = [o for o in base if not o.startswith(FLAGS)]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "titan_exp.perf.calibrate", *overrides, "--world", "1",
                          *(["--tiny"] if smoke else ["--compile"])], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    if out.returncode:
        raise SystemExit(f"calibration failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return f"calibrated in {time.perf_counter() - start:.0f} s"


def measure(name: str, overrides: list[str], run_dir: Path, cuda: bool) -> dict:
    """One configuration: its summary's numbers, and the planner's predictions beside them."""
    import torch

    from titan_exp.perf.memory import predict_memory
    from titan_exp.perf.profile import this_machine
    from titan_exp.perf.step import predict_step
    from titan_exp.validation import resolve

    if reason := skip_reason(name, cuda):
        return {"config": name, "status": "skipped", "reason": reason}
    torch._dynamo.reset()  # the in-process (smoke) runs must not reuse each other's compiled code
    start = time.perf_counter()
    code, summary = run_job(overrides, run_dir)
    summary = summary or {"status": "failed", "error": "no summary"}
    job = resolve(job_config(overrides))
    predicted = predict_memory(job, cuda=cuda)["total"]
    profile = this_machine(1, cuda=cuda)
    step = predict_step(job, profile, cuda=cuda)
    measured_step = job.training.global_batch_size * job.training.seq_len / summary["tokens_per_second_per_device"] \
        if summary.get("tokens_per_second_per_device") else None
    measured = summary.get("peak_memory_gib")
    low_precision = "float8" in name or "mx" in name
    return {
        "config": name,
        "status": summary["status"],
        "reason": (summary.get("error") or "")[:300],
        "tokens_per_second": summary.get("tokens_per_second_per_device"),
        "mfu": None if low_precision else summary.get("mfu"),
        "peak_memory_gib": measured,
        "predicted_memory_gib": predicted,
        "memory_error_pct": 100 * (predicted - measured) / measured if measured else None,
        "step_s": measured_step,
        "predicted_step_s": step.step_s,
        "step_profile": profile.source,
        "compile_s": summary.get("compile_s"),
        "compile_cache": summary.get("compile_cache"),
        "final_loss": summary.get("final_loss"),
        "wall_s": time.perf_counter() - start,
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
                     f"(target >= {TARGETS['float8_speedup']}): {'met' if ratio >= TARGETS['float8_speedup'] else 'missed'}")
    if "bf16 + compile, read every step" in by and "bf16 + compile" in by:
        ratio = by["bf16 + compile"]["tokens_per_second"] / by["bf16 + compile, read every step"]["tokens_per_second"]
        lines.append(f"reading the loss only on log steps / every step: tokens/s x {ratio:.3f}")
    steps = [abs(r["predicted_step_s"] / r["step_s"] - 1) * 100 for r in by.values() if r.get("step_s")]
    if steps:
        lines.append(f"planner step time ({rows[0]['step_profile']} profile): median |error| "
                     f"{sorted(steps)[len(steps) // 2]:.0f} %, worst {max(steps):.0f} % over {len(steps)} runs")
    errors = [abs(r["memory_error_pct"]) for r in by.values() if r["memory_error_pct"] is not None]
    if errors:
        worst = max(errors)
        lines.append(f"planner memory: worst |error| {worst:.1f} % over {len(errors)} runs (target <= "
                     f"{TARGETS['memory_error_pct']:g} %): {'met' if worst <= TARGETS['memory_error_pct'] else 'missed'}")
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
                  "| config | status | tokens/s | MFU % | peak GiB | predicted GiB | error % | step s | predicted s "
                  "| compile s | reason |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append("| " + " | ".join([
                r["config"], r["status"], fmt(r.get("tokens_per_second")), fmt(r.get("mfu")),
                fmt(r.get("peak_memory_gib"), 2), fmt(r.get("predicted_memory_gib"), 2), fmt(r.get("memory_error_pct")),
                fmt(r.get("step_s"), 3), fmt(r.get("predicted_step_s"), 3), fmt(r.get("compile_s")), (r.get("reason") or "").replace("|", "/")]) + " |")
        lines += ["", f"- {results['calibration'][model]}"] + [f"- {line}" for line in results["checks"][model]] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the same code paths on CPU with a tiny model")
    parser.add_argument("--models", nargs="+", default=["llama3_1b"], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 30; smoke 3)")
    parser.add_argument("--out", type=Path, default=REPO / "gpu_suite")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        parser.error("no CUDA device here; run with --smoke to exercise the suite on CPU")
    steps = args.steps or (3 if args.smoke else 30)
    models = ["smoke"] if args.smoke else args.models
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name() if cuda else "CPU", "smoke": args.smoke,
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "cuda_tests": cuda_tests(),
               "models": {}, "checks": {}, "calibration": {}}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TITAN_EXP_CACHE"] = str(Path(tmp) / "cache")  # compile starts cold
        for model in models:
            base = overrides_for(model, steps, args.smoke)
            results["calibration"][model] = calibrate(base, args.smoke)
            rows = [measure(name, [*base, *extra], Path(tmp) / model / str(i), cuda)
                    for i, (name, extra) in enumerate(CONFIGS.items())]
            warm = measure("bf16 + compile", [*base, *CONFIGS["bf16 + compile"]], Path(tmp) / model / "warm", cuda)
            rows.append({**warm, "config": "bf16 + compile, warm cache"})
            results["models"][model] = rows
            results["checks"][model] = checks(rows, cuda)
    (args.out / "gpu_suite.json").write_text(json.dumps(results, indent=2))
    (args.out / "gpu_suite.md").write_text(to_markdown(results))
    print(to_markdown(results))
    failed = [r["config"] for rows in results["models"].values() for r in rows if r["status"] not in ("ok", "skipped")]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed or results["cuda_tests"]["returncode"] not in (0, 5) else 0


if __name__ == "__main__":
    raise SystemExit(main())
