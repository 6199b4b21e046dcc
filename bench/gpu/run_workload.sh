#!/usr/bin/env bash
# Issue 15's GPU measurements for one machine kind, in one command under a time budget (default 560 s: each
# command is meant to end within 10 minutes). Steps run in the order given (default: all of the kind's, most wanted first); a
# step starts only if its minimum fits in what is left, and gets what is left as its limit.
#   h200:   workload (python -m bench.gpu.workload: 0.5B, ours async + sync-with-sleep, TRL colocate +/- sleep),
#           sleep (GPU sleep-mode tests: memory freed, sleep/wake times, parity; SLEEP_RESULT lines in run.log),
#           startup (python -m bench.gpu.startup_probe on the warm-started 0.5B: phases, cold and warm cache),
#           workload15 (the 1.5B shape: ours async + sync, TRL colocate)
#   h200x2: workload2 (python -m bench.gpu.workload --layout 2gpu: engine alone, ours async, TRL AsyncGRPOTrainer)
# TRL's pure-Python wheels (bench/gpu/fetch_trl_wheels.sh, $TRL_WHEELS, default .cache/gpu-trl) are unpacked into
# /tmp/trl-site. Everything lands in $OUT, in few files: summary.txt, setup.log, run.log (all steps' output), and
# the steps' JSON.
# Usage, from the repository root (host setup sourced first where needed):
#   bash bench/gpu/run_workload.sh h200|h200x2 [BUDGET_S] [STEP...]
KIND=${1:?usage: run_workload.sh h200|h200x2 [BUDGET_S] [STEP...]}; BUDGET=${2:-560}; shift $(( $# < 2 ? $# : 2 ))
source bench/gpu/common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # shared GPUs: no multicast
case $KIND in
  h200) STEPS=${*:-workload sleep startup workload15};;
  h200x2) STEPS=${*:-workload2};;
  *) echo "unknown kind $KIND (h200 or h200x2)" >&2; exit 2;;
esac
TRL_WHEELS=${TRL_WHEELS:-.cache/gpu-trl}
[ -d /tmp/trl-site ] || for w in "$TRL_WHEELS"/*.whl; do "$PY" -m zipfile -e "$w" /tmp/trl-site; done
LOG="$OUT/run.log"
# WORKLOAD_ARGS: more flags for every workload step (e.g. "--steps 24 --max-staleness 4").
read -r -a EXTRA <<< "${WORKLOAD_ARGS:-}"
WL=(-m bench.gpu.workload --out "$OUT" --trl-python "$PY" --trl-path /tmp/trl-site "${EXTRA[@]}")
Q05=.cache/bench/gpu-workload/qwen2-0.5b-warm
for s in $STEPS; do case $s in
  workload) run workload 300 "$PY" "${WL[@]}" --deadline-s $(( $(left) - 25 ));;
  workload15) run workload15 240 "$PY" "${WL[@]}" --shapes qwen2-1.5b --sides async,sync,trl --tag q15 \
      --micro-batch-tokens 32768 --deadline-s $(( $(left) - 25 ));;
  workload2) run workload2 300 "$PY" "${WL[@]}" --layout 2gpu --deadline-s $(( $(left) - 25 ));;
  sleep) run sleep 90 "$PY" -m pytest -o addopts="" -q -s -m gpu -k sleep tests/engines/vllm_local/test_gpu.py;;
  startup) [ -f "$Q05/config.json" ] || Q05=/tmp/q05-probe
    [ -f "$Q05/config.json" ] || run build_probe_model 60 "$PY" -m bench.gpu.countdown build "$Q05"
    run startup 150 "$PY" -m bench.gpu.startup_probe "$Q05" --out "$OUT" --timeout 150 \
      --variants "${PROBE_VARIANTS:-graphs,nocompile,eager}";;
  *) echo "unknown step $s" | tee -a "$OUT/$SUMMARY";;
esac; done
grep -hE "^\[|summary:|SLEEP_RESULT|passed|failed|Error|\"variant\"" "$LOG" | grep -v WARNING | tail -40
