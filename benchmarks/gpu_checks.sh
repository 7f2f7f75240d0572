#!/usr/bin/env bash
# The GPU checks in one script, for a machine with a CUDA torch and this package's dependencies
# (run from the checkout; PYTHONPATH=. if it is not installed). Each stage has a time limit within
# TOTAL_S and its results are packed into $OUT after it, so a call that is cut short still returns
# what ran:
#     bash benchmarks/gpu_checks.sh [GRID_MINUTES] [SUITE_MINUTES] [TOTAL_S]   # -> $OUT/gpu_session.tgz
#   1. the GPU, driver and versions (gpu.txt);
#   2. a smoke launch (debug model, float8 + compile + selective AC, 4 steps): if it fails, the
#      script stops there and returns its log;
#   3. python -m benchmarks.gpu_grid $GRID at seq 8192, one sequence a step: calibration, then every
#      member of AC x compile x precision it starts in GRID_MINUTES (default 5), eager ones first;
#   4. python -m benchmarks.gpu_suite on llama3_3b, the rows named in $SUITE (|-separated), predicted
#      from the grid's calibrated profile, in what is left of TOTAL_S (default 560).
# Other stages, each a call of its own on the same machine:
#     GRID=... bash benchmarks/gpu_checks.sh resume [AUTOTUNE_MINUTES] [TOTAL_S]   # -> gpu_session_resume.tgz
#   the grid's members the first call left, then `launch.py -m +sweep=autotune` against the grid,
#   from the profile the first call calibrated (a quarter of the grid's time unless AUTOTUNE_MINUTES);
#     bash benchmarks/gpu_checks.sh checks [TOTAL_S]   # -> gpu_session_checks.tgz
#   the held-out checks BENCHMARKS.md names that wait for a GPU: the 1B suite's MoE row with the
#   grouped GEMM and its eager full-AC row, predicted from the spec sheet;
#     bash benchmarks/gpu_checks.sh float8 [TOTAL_S]   # -> gpu_session_float8.tgz
#   the 3B's float8 + compile beside bf16 + compile, then under the two Inductor settings of
#   gpu_suite.INDUCTOR_ENV (BENCHMARKS.md names the check).
# SMOKE=1 runs the same stages on CPU with the tools' tiny --smoke models (tests/test_gpu_suite.py,
# `-m slow`); GPU_SESSION_DIR (default /tmp/gpu_session) is where the stages write before packing.
set -u
out=${OUT:-/tmp/gpu_session_out}
r=${GPU_SESSION_DIR:-/tmp/gpu_session}
smoke=${SMOKE:+--smoke}
mkdir -p "$out" "$r"
export TITAN_EXP_CACHE=${TITAN_EXP_CACHE:-/tmp/titan_exp_cache} PYTHONUNBUFFERED=1
pack() { tar czf "$out/gpu_session.tgz" -C "$r" . ; }
if [ "${1:-}" = resume ]; then
  timeout "${3:-200}" python3 -m benchmarks.gpu_grid $smoke ${GRID:---model llama3_3b} --global-batch 1 \
      --resume "$r/grid/gpu_grid.json" --no-calibrate --budget-minutes 2 --autotune ${2:+--autotune-minutes "$2"} \
      --out "$r/grid2" > "$r/grid2.log" 2>&1
  echo "grid and autotune rc=$?"; tail -30 "$r/grid2.log"
  tar czf "$out/gpu_session_resume.tgz" -C "$r" grid2 grid2.log
  exit 0
fi
if [ "${1:-}" = checks ]; then
  timeout "${2:-300}" python3 -m benchmarks.gpu_suite $smoke --models llama3_1b \
      --configs "MoE 8 experts top-2, bf16 + compile" "bf16 eager, AC full" --steps 12 --no-tests --no-calibrate \
      --out "$r/checks" > "$r/checks.log" 2>&1
  echo "checks rc=$?"; tail -30 "$r/checks.log"
  tar czf "$out/gpu_session_checks.tgz" -C "$r" checks checks.log
  exit 0
fi
if [ "${1:-}" = float8 ]; then
  timeout "${2:-330}" python3 -m benchmarks.gpu_suite $smoke --models llama3_3b --configs "float8 tensorwise + compile" \
      "bf16 + compile" "float8 tensorwise + compile, looped reductions" "float8 tensorwise + compile, coordinate descent" \
      "bf16 + compile, coordinate descent" --steps 12 --no-tests --no-calibrate \
      --out "$r/float8" > "$r/float8.log" 2>&1
  echo "float8 rc=$?"; tail -30 "$r/float8.log"
  tar czf "$out/gpu_session_float8.tgz" -C "$r" float8 float8.log
  exit 0
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv
  python3 -c "import torch, torchao; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchao', torchao.__version__)"
} > "$r/gpu.txt" 2>&1
cat "$r/gpu.txt"
start=$SECONDS
timeout 120 python3 launch.py model=debugmodel training.steps=4 training.seq_len=256 precision=float8 \
    compile.enable=true activation_checkpoint.mode=selective cluster.nproc_per_node=1 \
    hydra.run.dir="$r/smoke" > "$r/smoke.log" 2>&1
rc=$?
echo "smoke rc=$rc in $((SECONDS - start)) s"; tail -5 "$r/smoke.log"
if [ $rc -ne 0 ]; then pack; exit 1; fi
total=${3:-560}
left() { echo $(( total - SECONDS < $1 ? total - SECONDS : $1 )); }  # seconds: at most $1, what TOTAL_S leaves
start=$SECONDS
grid_minutes=${1:-5}
timeout "$(left "$(python3 -c "print(int(60 * $grid_minutes + 100))")")" python3 -m benchmarks.gpu_grid $smoke ${GRID:---model llama3_3b} \
    --global-batch 1 --budget-minutes "$grid_minutes" --out "$r/grid" > "$r/grid.log" 2>&1
echo "grid rc=$? in $((SECONDS - start)) s"; tail -25 "$r/grid.log"
pack
if [ "$(left 60)" -lt 60 ]; then echo "suite: not run, under 60 s of TOTAL_S left"; exit 0; fi
start=$SECONDS
suite_minutes=${2:-1.5}
IFS='|' read -r -a suite <<< "${SUITE:-bf16 + compile, traced|float8 tensorwise + compile, traced|float8 tensorwise + compile, AC full, traced}"
timeout "$(left 600)" python3 -m benchmarks.gpu_suite $smoke --models llama3_3b \
    --configs "${suite[@]}" --steps 12 --no-tests --no-calibrate \
    --budget-minutes "$suite_minutes" --out "$r/suite" > "$r/suite.log" 2>&1
echo "suite rc=$? in $((SECONDS - start)) s"; tail -25 "$r/suite.log"
pack
