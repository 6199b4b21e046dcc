# Sourced by the bench/gpu/run_*.sh device scripts: unpack vLLM 0.26.0 from .gpu/, quiet it, and define
#   step NAME LIMIT CMD...   run CMD with a time limit, log to $OUT/NAME.log, append "NAME rc= Ns" to the summary
#   build_q05                build the Qwen2-0.5B-shaped model in /tmp/q05 (its own process) unless it exists
# Callers set SUMMARY (default summary.txt) and SETUP_LOG (default setup.log) before sourcing if they need to.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SETUP_LOG=${SETUP_LOG:-setup.log}
SUMMARY=${SUMMARY:-summary.txt}
source .gpu/setup.sh > "$OUT/$SETUP_LOG" 2>&1 || { cat "$OUT/$SETUP_LOG"; exit 2; }
export VLLM_LOGGING_LEVEL=WARNING PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t0))s" | tee -a "$OUT/$SUMMARY"; }
build_q05() { [ -d /tmp/q05 ] || step build 150 python3 bench/gpu/build_qwen05.py /tmp/q05; }
