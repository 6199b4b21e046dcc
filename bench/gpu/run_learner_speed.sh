#!/usr/bin/env bash
# The learner's speed options on one H200: the GPU varlen tests, the side-by-side ladder (packed sdpa, varlen,
# + compiled element-wise chains, at 1x and 2x micro-batch tokens), and a kernel-time profile of the fastest setting.
# Usage, from the repository root:  bash bench/gpu/run_learner_speed.sh   (logs and JSON land in $OUT)
source bench/gpu/common.sh
step gpu_varlen_tests 120 "$PY" -m pytest -o addopts="" -q -m gpu tests/test_gpu_varlen.py
step learner_ladder 320 "$PY" -m bench.gpu.learner_speed --shape qwen2-0.5b --ladder --out "$OUT"
step learner_profile 140 "$PY" -m bench.gpu.profile_learner --shape qwen2-0.5b --packing --micro-batch-tokens 32768 \
  --varlen --compile --out "$OUT"
grep -h "by kind\|passed\|failed\|tokens/s" "$OUT"/gpu_varlen_tests.log "$OUT"/learner_ladder.log "$OUT"/learner_profile.log
