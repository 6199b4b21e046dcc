#!/usr/bin/env bash
# Device run on one H200 (vLLM 0.26.0 from .gpu/): async vs sync on the Qwen2-0.5B shape (bench/async_vs_sync.py).
# Usage (device tool, kind nvidia-h200, carry [".gpu"]):  bash bench/gpu/run_h200_async.sh   (log + JSON in $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .gpu/setup.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 2; }
export VLLM_LOGGING_LEVEL=WARNING PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"; }
[ -d /tmp/q05 ] || step build 150 python3 bench/gpu/build_qwen05.py /tmp/q05
ASYNCRL_BENCH_MODEL=/tmp/q05 step async_vs_sync 480 python3 bench/async_vs_sync.py --quick --max-num-seqs 64
cp bench/results/async_vs_sync_h200.json "$OUT/" 2>/dev/null
grep -v WARNING "$OUT/async_vs_sync.log" | tail -8
