#!/usr/bin/env bash
# Runs on two H200s of one host (vLLM 0.26.0, and the packages its OpenAI API server needs).
#   part 1: the NCCL weight transport against a vLLM HTTP server
#           (tests/engines/vllm_remote/test_remote_engine.py, gpu marker),
#           then the weight-sync benchmark on a Qwen2-0.5B shape with the learner colocated (CUDA IPC path).
#   part 2: the benchmark again, the in-process GPU tests (both weight transfers), the benchmark over files.
#   nccl:   the NCCL test alone, with its sync times printed.
# Usage, from the repository root:  bash bench/gpu/run_h200_x2.sh 1 | 2 | nccl      (logs and JSON in $OUT)
PART=${1:-1}
SUMMARY="summary$PART.txt"
source bench/gpu/common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # the host's GPUs are shared: no NVLink multicast
ws() {  # ws STEP KIND LIMIT [FLAGS...]: weight-sync on the 0.5B shape, its JSON kept as weight_sync_KIND_h200.json
  local name=$1 kind=$2 limit=$3; shift 3
  ASYNCRL_BENCH_MODEL=/tmp/q05 step "$name" "$limit" "$PY" -m bench.cpu.weight_sync --sizes 1gib --background 4 \
    --out "$OUT" "$@"
  mv "$OUT/weight_sync_h200.json" "$OUT/weight_sync_${kind}_h200.json" 2>/dev/null
}
[ "$PART" = nccl ] || build_q05
if [ "$PART" = nccl ]; then
  step nccl 300 "$PY" -m pytest -o addopts="" -q -s -m gpu -k nccl tests/engines/vllm_remote/test_remote_engine.py
elif [ "$PART" = 1 ]; then
  step nccl 240 "$PY" -m pytest -o addopts="" -q -m gpu -k nccl tests/engines/vllm_remote/test_remote_engine.py
  ws ws_ipc ipc 180 --reps 5
else
  ws ws_ipc2 ipc 180 --reps 5
  step gpu_tests 240 "$PY" -m pytest -o addopts="" -q -m gpu tests/engines/vllm_local/test_gpu.py
  ws ws_files files 150 --reps 3 --transfer files
fi
grep -hE "passed|failed|skipped|error|^E |paused|NCCL sync" "$OUT"/*.log | grep -v WARNING | tail -30
