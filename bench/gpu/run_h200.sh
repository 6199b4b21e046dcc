#!/usr/bin/env bash
# One device run on the lent H200 (vLLM 0.26.0 from .gpu/): GPU tests, then the weight-sync, engine-limit
# and async-vs-sync benchmarks on a Qwen2-0.5B-shaped model built in its own process.
# Usage (device tool, carry [".gpu"]):  bash bench/gpu/run_h200.sh   (logs and JSON land in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 2; }
export VLLM_LOGGING_LEVEL=WARNING PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; }
step build 120 python3 bench/gpu/build_qwen05.py /tmp/q05
step gpu_tests 150 python3 -m pytest -o addopts="" -q -m gpu tests/test_gpu.py
export ASYNCRL_BENCH_MODEL=/tmp/q05
step weight_sync 150 python3 bench/weight_sync.py --sizes 1gib --reps 3 --background 4
step engine_limit 130 python3 bench/engine_limit.py --quick --max-num-seqs 256
step async_vs_sync 170 python3 bench/async_vs_sync.py --quick
cp bench/results/*_h200.json "$OUT/" 2>/dev/null
tail -3 "$OUT"/*.log | tail -40
