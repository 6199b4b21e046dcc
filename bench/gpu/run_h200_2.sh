#!/usr/bin/env bash
# Second device run: GPU tests (spawned workers) and the weight-sync benchmark with prepare-before-pause.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 2; }
export VLLM_LOGGING_LEVEL=WARNING PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; }
step build 120 python3 bench/gpu/build_qwen05.py /tmp/q05
ASYNCRL_BENCH_MODEL=/tmp/q05 step weight_sync 130 python3 bench/weight_sync.py --sizes 1gib --reps 3 --background 4
step gpu_tests 90 python3 -m pytest -o addopts="" -q -m gpu tests/test_gpu.py
cp bench/results/weight_sync_h200.json "$OUT/" 2>/dev/null
grep -v WARNING "$OUT/weight_sync.log" | tail -4; grep -E "passed|failed|^E " "$OUT/gpu_tests.log" | tail -5
