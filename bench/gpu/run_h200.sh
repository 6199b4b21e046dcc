#!/usr/bin/env bash
# One device run on the lent H200 (vLLM 0.26.0 from .gpu/): GPU tests, then the weight-sync and engine-limit
# benchmarks on a Qwen2-0.5B-shaped model built in its own process. Async vs sync needs a run of its own
# (bench/gpu/run_h200_async.sh): it does not fit in what this one leaves of a device call.
# Usage (device tool, carry [".gpu"]):  bash bench/gpu/run_h200.sh   (logs and JSON land in $OUT)
source bench/gpu/common.sh
build_q05
step gpu_tests 150 python3 -m pytest -o addopts="" -q -m gpu tests/test_gpu.py
export ASYNCRL_BENCH_MODEL=/tmp/q05
step weight_sync 150 python3 bench/weight_sync.py --sizes 1gib --reps 3 --background 4
step engine_limit 130 python3 bench/engine_limit.py --quick --max-num-seqs 256
cp bench/results/*_h200.json "$OUT/" 2>/dev/null
tail -3 "$OUT"/*.log | tail -40
