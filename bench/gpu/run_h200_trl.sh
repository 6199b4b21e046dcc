#!/usr/bin/env bash
# One run on an H200 (vLLM 0.26.0): python -m bench.peers.vs_trl's gen-heavy profile against TRL 1.16.0's GRPOTrainer,
# with transformers generation and with its vLLM colocate mode (the same vLLM as ours). TRL runs in $PY with the
# pure-Python wheels it lacks (trl, datasets, dill, multiprocess: bench/gpu/fetch_trl_wheels.sh) unpacked from
# $TRL_WHEELS (default .cache/gpu-trl). Both sides train float32 weights under bf16 autocast. Our engine: eager,
# CUDA graphs (graphs), or CUDA graphs with the learner and the engine sharing the GPU through CUDA MPS (mps: the
# daemon runs for this script only).
# Usage, from the repository root:  bash bench/gpu/run_h200_trl.sh [eager|graphs|mps] [STEPS]    (log + JSON in $OUT)
source bench/gpu/common.sh
MODE=${1:-graphs}; STEPS=${2:-30}
TRL_WHEELS=${TRL_WHEELS:-.cache/gpu-trl}
[ -d /tmp/trl-site ] || for w in "$TRL_WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" /tmp/trl-site; done
VLLM_SITE=$("$PY" -c "import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))")
EAGER=--no-enforce-eager; [ "$MODE" = eager ] && EAGER=--enforce-eager
if [ "$MODE" = mps ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p /tmp/mps /tmp/mps-log && nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
step "vs_trl_$MODE" 560 "$PY" -m bench.peers.vs_trl --profiles genheavy --steps "$STEPS" $EAGER \
  --trl-python "$PY" --trl-path /tmp/trl-site --trl-threads 0 --trl-vllm --trl-vllm-path "$VLLM_SITE" \
  --no-try-vllm-colocate --out "$OUT"
mv "$OUT/vs_trl_h200.json" "$OUT/vs_trl_${MODE}_h200.json" 2>/dev/null
grep -E "^\[|ours /|Error|error" "$OUT/vs_trl_$MODE.log" | tail -20
