#!/usr/bin/env bash
# Device runs on two H200s (vLLM 0.26.0 from .gpu/, the API server's extra packages from .cache/gpu-extra).
#   part 1: the NCCL weight transport against a vLLM HTTP server (tests/test_remote_engine.py, gpu marker),
#           then the weight-sync benchmark on a Qwen2-0.5B shape with the learner colocated (CUDA IPC path).
#   part 2: the benchmark again, the in-process GPU tests (both weight transfers), the benchmark over files.
# Usage (device tool, kind nvidia-h200-x2, carry [".gpu", ".cache/gpu-extra"]):
#   bash bench/gpu/run_h200_x2.sh 1   then   bash bench/gpu/run_h200_x2.sh 2      (logs and JSON land in $OUT)
PART=${1:-1}
SETUP_LOG="setup$PART.log"
SUMMARY="summary$PART.txt"
source bench/gpu/common.sh
export PYTHONPATH="$PWD/.cache/gpu-extra/site:$PWD:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # the host's GPUs are shared: no NVLink multicast
[ "$PART" = nccl ] || build_q05
if [ "$PART" = nccl ]; then  # the NCCL test alone, with its sync times printed
  step nccl 300 python3 -m pytest -o addopts="" -q -s -m gpu -k nccl tests/test_remote_engine.py
elif [ "$PART" = 1 ]; then
  step nccl 240 python3 -m pytest -o addopts="" -q -m gpu -k nccl tests/test_remote_engine.py
  ASYNCRL_BENCH_MODEL=/tmp/q05 step ws_ipc 180 python3 bench/weight_sync.py --sizes 1gib --reps 5 --background 4
  cp bench/results/weight_sync_h200.json "$OUT/weight_sync_ipc_h200.json" 2>/dev/null
else
  ASYNCRL_BENCH_MODEL=/tmp/q05 step ws_ipc2 180 python3 bench/weight_sync.py --sizes 1gib --reps 5 --background 4
  cp bench/results/weight_sync_h200.json "$OUT/weight_sync_ipc_h200.json" 2>/dev/null
  step gpu_tests 240 python3 -m pytest -o addopts="" -q -m gpu tests/test_gpu.py
  ASYNCRL_BENCH_MODEL=/tmp/q05 step ws_files 150 python3 bench/weight_sync.py --sizes 1gib --reps 3 \
    --background 4 --transfer files
  cp bench/results/weight_sync_h200.json "$OUT/weight_sync_files_h200.json" 2>/dev/null
fi
grep -hE "passed|failed|skipped|error|^E |paused|NCCL sync" "$OUT"/*.log | grep -v WARNING | tail -30
