# Sourced by the bench/gpu/run_*.sh scripts, which run from the repository root with a Python that imports
# torch (CUDA) and vLLM: python3, or $PYTHON. Anything a particular host needs first (unpacking vLLM, extra
# site directories) is the caller's to source before running a script, e.g.  source SETUP && bash bench/gpu/X.sh
# Defines
#   PY                       the interpreter ($PYTHON, default python3)
#   step NAME LIMIT CMD...   run CMD with a time limit, log to $OUT/NAME.log, append "NAME rc= Ns" to the summary
#   build_q05                build the Qwen2-0.5B-shaped model in /tmp/q05 (its own process) unless it exists
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
