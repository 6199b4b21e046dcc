#!/usr/bin/env bash
# One run on an H200 (vLLM 0.26.0): async vs sync on the Qwen2-0.5B shape (python -m bench.cpu.async_vs_sync).
# Usage, from the repository root:  bash bench/gpu/run_h200_async.sh      (log + JSON in $OUT; see common.sh)
source bench/gpu/common.sh
build_q05
ASYNCRL_BENCH_MODEL=/tmp/q05 step async_vs_sync 480 "$PY" -m bench.cpu.async_vs_sync --quick --max-num-seqs 64 \
  --out "$OUT"
grep -v WARNING "$OUT/async_vs_sync.log" | tail -8
