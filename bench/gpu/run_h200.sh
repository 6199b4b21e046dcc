#!/usr/bin/env bash
# One run on an H200 (vLLM 0.26.0): GPU tests, then the weight-sync and engine-limit benchmarks on a
# Qwen2-0.5B-shaped model built in its own process. Async vs sync needs a run of its own
# (bench/gpu/run_h200_async.sh).
# Usage, from the repository root:  bash bench/gpu/run_h200.sh      (logs and JSON land in $OUT; see common.sh)
source bench/gpu/common.sh
build_q05
step gpu_tests 150 "$PY" -m pytest -o addopts="" -q -m gpu tests/engines/vllm_local/test_gpu.py
export ASYNCRL_BENCH_MODEL=/tmp/q05
step weight_sync 150 "$PY" -m bench.cpu.weight_sync --sizes 1gib --reps 3 --background 4 --out "$OUT"
step engine_limit 130 "$PY" -m bench.cpu.engine_limit --quick --max-num-seqs 256 --out "$OUT"
tail -3 "$OUT"/*.log | tail -40
