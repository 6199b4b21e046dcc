#!/usr/bin/env bash
# Device run on one H200 (vLLM 0.26.0 from .gpu/): async vs sync on the Qwen2-0.5B shape (bench/async_vs_sync.py).
# Usage (device tool, kind nvidia-h200, carry [".gpu"]):  bash bench/gpu/run_h200_async.sh   (log + JSON in $OUT)
source bench/gpu/common.sh
build_q05
ASYNCRL_BENCH_MODEL=/tmp/q05 step async_vs_sync 480 python3 bench/async_vs_sync.py --quick --max-num-seqs 64
cp bench/results/async_vs_sync_h200.json "$OUT/" 2>/dev/null
grep -v WARNING "$OUT/async_vs_sync.log" | tail -8
