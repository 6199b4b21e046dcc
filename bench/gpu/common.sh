# Sourced by the bench/gpu/run_*.sh scripts, which run from the repository root with a Python that imports
# torch (CUDA) and vLLM: python3, or $PYTHON. Anything a particular host needs first (unpacking vLLM, extra
# site directories) is the caller's to source before running a script, e.g.  source SETUP && bash bench/gpu/X.sh
# Defines
#   PY                       the interpreter ($PYTHON, default python3)
#   step NAME LIMIT CMD...   run CMD with a time limit, log to $OUT/NAME.log, append "NAME rc= Ns" to the summary
#   build_q05                build the Qwen2-0.5B-shaped model in /tmp/q05 (its own process) unless it exists
#   run NAME MIN_S CMD...    (with LOG and BUDGET set) CMD in its own process group, output to $LOG, under the
#                            time left in BUDGET less a margin, skipped if less than MIN_S is left
# Results and logs land in $OUT (default /tmp/out). Callers set SUMMARY (default summary.txt) before sourcing
# if they need another summary file.
set -u
[ -f bench/common.py ] || { echo "bench/gpu: run from the repository root (python -m bench.gpu.NAME)" >&2; exit 2; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SUMMARY=${SUMMARY:-summary.txt}
PY=${PYTHON:-python3}
export VLLM_LOGGING_LEVEL=WARNING PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # asyncrl importable in the processes vLLM starts, too
"$PY" -c "import torch, vllm; print('vllm', vllm.__version__, 'cuda', torch.cuda.is_available())" \
  > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; echo "bench/gpu: $PY cannot import vllm" >&2; exit 2; }
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/$SUMMARY"; }
build_q05() { [ -d /tmp/q05 ] || step build 150 "$PY" -m bench.gpu.build_qwen05 /tmp/q05; }
left() { echo $(( BUDGET - SECONDS )); }  # from the script's start: its setup (a vLLM import) is ~30 s
run() {  # run NAME MIN_S CMD...: in its own process group, under a limit of what is left (less a margin);
  # at the limit, or once it is done, the whole group goes (engines, servers and TRL runs it started included)
  local name=$1 min=$2; shift 2; local limit=$(( $(left) - 15 )) t=$SECONDS
  if [ "$limit" -lt "$min" ]; then echo "$name skipped: ${limit}s left, needs ${min}s" | tee -a "$OUT/$SUMMARY"; return; fi
  echo "===== $name (limit ${limit}s): $*" >> "$LOG"
  setsid "$@" >> "$LOG" 2>&1 &
  local pid=$!
  ( sleep "$limit" & s=$!; trap 'kill $s 2>/dev/null; exit' TERM; wait $s
    kill -TERM -- "-$pid" 2>/dev/null; sleep 10; kill -KILL -- "-$pid" 2>/dev/null ) &
  local watchdog=$!
  wait "$pid"; local rc=$?
  kill "$watchdog" 2>/dev/null; wait "$watchdog" 2>/dev/null
  kill -KILL -- "-$pid" 2>/dev/null
  echo "$name rc=$rc $((SECONDS - t))s" | tee -a "$OUT/$SUMMARY"
}
