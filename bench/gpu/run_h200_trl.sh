#!/usr/bin/env bash
# Device run on one H200 (vLLM 0.26.0 from .gpu/): bench/vs_trl.py's gen-heavy profile against TRL 1.16.0's
# GRPOTrainer, with transformers generation and with its vLLM colocate mode (the same vLLM 0.26 tree).
# Both sides train float32 weights under bf16 autocast. Our engine: eager, CUDA graphs (graphs), or CUDA graphs
# with the learner and the engine sharing the GPU through CUDA MPS (mps: the daemon runs for this call only).
# Usage (device tool, kind nvidia-h200, carry [".gpu", ".cache/gpu-trl"], after bench/gpu/fetch_trl_wheels.sh):
#   bash bench/gpu/run_h200_trl.sh [eager|graphs|mps] [STEPS]      (log + JSON in $OUT)
source bench/gpu/common.sh
MODE=${1:-graphs}; STEPS=${2:-30}
[ -d /tmp/trl-site ] || for w in .cache/gpu-trl/*.whl; do python3 -m zipfile -e "$w" /tmp/trl-site; done
EAGER=--no-enforce-eager; [ "$MODE" = eager ] && EAGER=--enforce-eager
if [ "$MODE" = mps ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps /tmp/mps-log && nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
step "vs_trl_$MODE" 560 python3 bench/vs_trl.py --profiles genheavy --steps "$STEPS" $EAGER \
  --trl-python python3 --trl-path /tmp/trl-site --trl-threads 0 --trl-vllm --trl-vllm-path /tmp/site \
  --no-try-vllm-colocate
cp bench/results/vs_trl_h200.json "$OUT/vs_trl_${MODE}_h200.json" 2>/dev/null
grep -E "^\[|ours /|Error|error" "$OUT/vs_trl_$MODE.log" | tail -20
