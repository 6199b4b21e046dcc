#!/usr/bin/env bash
# The learner's speed on one H200: host costs (bench/gpu/host_probe.py), the GPU varlen tests, the side-by-side
# ladder (packed sdpa, varlen, + compiled element-wise chains or compiled layers, at several micro-batch token
# sizes), and kernel-time profiles of the two compiled settings at the ladder's largest micro-batch.
# Usage, from the repository root:  bash bench/gpu/run_learner_speed.sh   (logs and JSON land in $OUT)
source bench/gpu/common.sh
step host_probe 60 "$PY" -m bench.gpu.host_probe --out "$OUT"
step gpu_varlen_tests 150 "$PY" -m pytest -o addopts="" -q -m gpu tests/algorithms/test_gpu_varlen.py
step learner_ladder 300 "$PY" -m bench.gpu.learner_speed --shape qwen2-0.5b --ladder --out "$OUT"
for compiled in --compile --compile-layers; do
  step "learner_profile$compiled" 120 "$PY" -m bench.gpu.profile_learner --shape qwen2-0.5b --packing \
    --micro-batch-tokens 65536 --varlen "$compiled" --out "$OUT"
done
grep -h "cpu_ops\|by kind\|passed\|failed\|tokens/s" "$OUT"/host_probe.log "$OUT"/gpu_varlen_tests.log \
  "$OUT"/learner_ladder.log "$OUT"/learner_profile*.log
