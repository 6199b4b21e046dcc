#!/usr/bin/env bash
# Issue 27's GPU measurements, under a time budget (default 560 s: a command ends within 10 minutes). Steps, in
# the order given (default: all):
#   tests   the GPU tests of the in-process engine's transports: CUDA IPC, files, sleep/wake, LoRA (pytest -m gpu)
#   ipc     python -m bench.cpu.weight_sync --sizes 1gib: the CUDA IPC pause after the transport refactor
#   lora05  python -m bench.gpu.lora on the 0.5B shape: LoRA against full fine-tuning, side by side
#   lora15  the same on the 1.5B shape
# PEFT's wheel (bench/gpu/fetch_peft_wheels.sh, $PEFT_WHEELS, default .cache/gpu-peft) is unpacked into
# /tmp/peft-site. $LORA_STEPS (default 12), $LORA_SIDES (default full,lora) and $LORA_ARGS (more bench.gpu.lora
# arguments, after the step's own: e.g. "--no-compile-layers --tag q05_eager") shape the lora steps. Results
# land in $OUT: summary.txt, one log per step, and the steps' JSON.
# Usage, from the repository root (host setup sourced first where needed):
#   bash bench/gpu/run_lora.sh [BUDGET_S] [STEP...]
BUDGET=${1:-560}; shift $(( $# < 1 ? $# : 1 ))
STEPS=${*:-tests ipc lora05 lora15}
source bench/gpu/common.sh
PEFT_WHEELS=${PEFT_WHEELS:-.cache/gpu-peft}
[ -d /tmp/peft-site ] || for w in "$PEFT_WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" /tmp/peft-site; done
export PYTHONPATH="$PYTHONPATH:/tmp/peft-site"
left() { echo $(( BUDGET - SECONDS - 10 )); }  # from the script's start, setup included
LORA=(-m bench.gpu.lora --out "$OUT" --steps "${LORA_STEPS:-12}" --lora-sides "${LORA_SIDES:-full,lora}")
for s in $STEPS; do case $s in
  tests) step tests "$(left)" "$PY" -m pytest -o addopts="" -v --no-header -m gpu tests/lora/test_lora_gpu.py \
      tests/engines/vllm_local/test_gpu.py;;
  ipc) step ipc "$(left)" "$PY" -m bench.cpu.weight_sync --sizes 1gib --reps 5 --background 4 --out "$OUT";;
  lora05) step lora05 "$(left)" "$PY" "${LORA[@]}" --shapes qwen2-0.5b --tag q05 ${LORA_ARGS:-};;
  lora15) step lora15 "$(left)" "$PY" "${LORA[@]}" --shapes qwen2-1.5b --micro-batch-tokens 32768 --tag q15 \
      ${LORA_ARGS:-};;
  *) echo "unknown step $s" | tee -a "$OUT/$SUMMARY";;
esac; done
grep -hE "passed|failed|Error|lora/full|\] (full|lora):" "$OUT"/*.log | tail -30
