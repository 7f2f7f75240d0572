#!/usr/bin/env bash
# What the 3B holds at its allocated peak on one GPU, for the grid's members whose peak the
# memory account misses: a few steps with the allocator's history recorded, then
# titan_exp.train.snapshot's reading of it ($OUT/<name>.json; the pickle is not kept).
#     bash benchmarks/gpu_memory_peak.sh ["NAME:OVERRIDES" ...]
set -u
out=${OUT:-/tmp/gpu_memory_peak}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
members=("$@")
[ ${#members[@]} -gt 0 ] || members=(
  "compiled_full_float8:compile.enable=true activation_checkpoint.mode=full precision=float8"
  "eager_selective_bf16:activation_checkpoint.mode=selective precision=bf16")
for m in "${members[@]}"; do
  name=${m%%:*}; overrides=${m#*:}
  start=$SECONDS
  timeout 150 python3 launch.py model=llama3_3b training.seq_len=8192 training.global_batch_size=1 \
      training.local_batch_size=1 training.steps=3 lr_scheduler.warmup_steps=1 cluster.nproc_per_node=1 \
      profiling.enable_memory_snapshot=true $overrides hydra.run.dir=/tmp/peak_$name > "$out/$name.log" 2>&1
  echo "$name: launch rc=$? in $((SECONDS - start)) s"; tail -2 "$out/$name.log"
  python3 -m titan_exp.train.snapshot /tmp/peak_$name/memory_snapshot/rank0_memory_snapshot.pickle --top 25 \
      > "$out/$name.json" 2>> "$out/$name.log"
  echo "$name: read rc=$? in $((SECONDS - start)) s"; head -c 3000 "$out/$name.json"; echo
done
