#!/usr/bin/env bash
# Issue 38's and 39's 7B measurements on one GPU, under a time budget (default 570 s: a command ends within 10
# minutes). The policy is the planted Qwen2.5-7B shape (bench.gpu.planted), answers lognormal of mean 512 up to
# 4,096 tokens. Steps, in the order given; a step left out of one command goes on in the next (--resume: sides
# already in the result file are kept, and each records the machine it ran on):
#   lora    ours, async, training a LoRA adapter (rank 32) on the frozen bf16 base: gpu_workload_<gpu>_q7.json
#   lorasync  ours, sync, the same, into the same file (async and sync together outlast one command at 7B)
#   alone   the LoRA-serving engine by itself at the producers' concurrency, into the same file: the most tokens/s
#           async could train, which bounds async / sync
#   share   the engine alone serving an adapter of zeros, then ours async with LoRA, $SHARE_STEPS (6) steps, into
#           gpu_workload_<gpu>_q7_share_adapter.json: where async's engine time goes (bench.gpu.engine_share: the
#           token counter and the running-request gauge against the learner's steps)
#   shared  the engine alone serving an adapter of zeros, then ours async with LoRA on the engine's own weights
#           (--share-base: the base held once), $SHARE_STEPS (6) steps: gpu_workload_<gpu>_q7_shared.json, the
#           whole-GPU peak against the lora step's, and where the engine's time goes (as share); $SHARED_SIDES
#           (default alone_lora,async_lora) picks the sides
#   trl     TRL GRPOTrainer with PEFT LoRA (same rank, targets, learning rate) and vLLM colocate, into the same file
#   full    ours, async, full fine-tuning: bf16 weights with adamw_bf16 (8 bytes a parameter with its gradient),
#           $FULL_STEPS steps (default 24) of 4 groups, answers of mean 256: gpu_workload_<gpu>_q7_full.json
#   fullsync  the engine alone at the full side's concurrency (the bound on async), then ours, sync (the engine
#           sleeps at level 2 during each step), into the same file, $SYNC_STEPS (8) steps
#   fp8     python -m bench.gpu.fp8 at the 7B shape: decode tokens/s FP8 / bf16 and the full-weight publication pause
#           (from the learner's weights in host memory: on 80 GiB a learner on the GPU does not fit beside both)
#   optim   python -m bench.gpu.optimizer at the 7B shape: adamw_bf16's step beside torch's fused AdamW
#   fp8learn  issue 39's learning run at 1.5B, another seed ($SEED, default 1): 24 async steps with FP8 rollouts
#           beside 24 with bf16 rollouts, the same warm start and prompts: gpu_workload_<gpu>_q15_fp8_s24_seed<SEED>.json.
#           On a fresh machine it needs a whole command: the warm start took 132 s, each engine's start ~110 s.
# PEFT's, TRL's and FP8's wheels (bench/gpu/fetch_peft_wheels.sh, fetch_trl_wheels.sh, fetch_fp8_wheels.sh: vLLM 0.26
# imports compressed-tensors to quantize at all) are unpacked under /tmp. Results
# land in $OUT: summary.txt, run.log and the JSON files.
# Usage, from the repository root (host setup sourced first):  bash bench/gpu/run_7b.sh [BUDGET_S] [STEP...]
BUDGET=${1:-570}; shift $(( $# < 1 ? $# : 1 ))
STEPS=${*:-lora lorasync}
source bench/gpu/common.sh
for pkg in peft trl fp8; do
  [ -d "/tmp/$pkg-site" ] || for w in ".cache/gpu-$pkg"/*.whl; do "$PY" -m zipfile -e "$w" "/tmp/$pkg-site"; done
done
export PYTHONPATH="$PYTHONPATH:/tmp/peft-site:/tmp/fp8-site" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
LOG="$OUT/run.log"
# Result files live where a warm machine keeps them between commands (a fresh $OUT comes with each), so that
# --resume finds the sides an earlier command measured; they are copied into $OUT after every step.
KEEP=.cache/bench/gpu-7b; mkdir -p "$KEEP"
# The engine's share for TRL's colocated vLLM: its weights (14.2 GiB), the same KV cache as ours, 4 GiB more.
TRL_SHARE=$("$PY" -c "import torch; print(round((14.2 + 10 + 4) * 2**30 / torch.cuda.mem_get_info()[1], 3))")
W7=(-m bench.gpu.workload --out "$KEEP" --shapes qwen2.5-7b --max-answer 4096 --mean-answer 512 --max-tokens 4100
    --kv-cache-gib 10 --micro-batch-tokens 32768 --memory-budget-gib 50 --no-engine-compile --resume
    --trl-python "$PY" --trl-path /tmp/trl-site --trl-path /tmp/peft-site --trl-gpu-memory-utilization "$TRL_SHARE")
# Full fine-tuning: 57 GiB of weights, gradients and bf16 AdamW states alone, so the learner's budget is 76 GiB
# (engine 28 + its 14.2 GiB of shadow weights + learner 76 + the 14.2 GiB publication snapshot: 132.4 GiB, inside
# the 134 GiB a 141 GiB H200 leaves usable). 24 steps of 8 groups of ~950-token answers would take an estimated
# ~23 s each at 7B, past one command; 4 groups of mean-256 answers fit.
FULL=(--tag q7_full --learner-dtype bfloat16 --optimizer adamw_bf16 --memory-budget-gib 76 --batch-groups 4
      --mean-answer 256)
deadline() { echo $(( $(left) - 25 )); }
for s in $STEPS; do case $s in
  lora) run lora 300 "$PY" "${W7[@]}" --sides async_lora --tag q7 --deadline-s "$(deadline)";;
  lorasync) run lorasync 300 "$PY" "${W7[@]}" --sides sync_lora --tag q7 --deadline-s "$(deadline)";;
  alone) run alone 240 "$PY" "${W7[@]}" --sides alone_lora --tag q7 --deadline-s "$(deadline)";;
  share) run share 300 "$PY" "${W7[@]}" --sides alone_lora,async_lora --tag q7_share_adapter \
      --steps "${SHARE_STEPS:-6}" --deadline-s "$(deadline)";;
  shared) run shared 300 "$PY" "${W7[@]}" --sides "${SHARED_SIDES:-alone_lora,async_lora}" --tag q7_shared \
      --share-base --steps "${SHARE_STEPS:-6}" --deadline-s "$(deadline)";;
  trl) run trl 300 "$PY" "${W7[@]}" --sides trl_lora --tag q7 --trl-timeout "$(deadline)" \
      --deadline-s "$(deadline)";;
  full) run full 300 "$PY" "${W7[@]}" "${FULL[@]}" --sides async --steps "${FULL_STEPS:-24}" --deadline-s "$(deadline)";;
  fullsync) run fullsync 300 "$PY" "${W7[@]}" "${FULL[@]}" --sides alone,sync --steps "${SYNC_STEPS:-8}" \
      --deadline-s "$(deadline)";;
  fp8) run fp8 240 "$PY" -m bench.gpu.fp8 --out "$KEEP" --shape qwen2.5-7b --kv-cache-gib 10 --learner-on-host \
      --also-seqs 16,64;;
  fp8learn) run fp8learn 480 "$PY" -m bench.gpu.workload --out "$KEEP" --shapes qwen2-1.5b --sides async,async_fp8 \
      --tag "q15_fp8_s24_seed${SEED:-1}" --seed "${SEED:-1}" --micro-batch-tokens 8192 --warm-batch 8 --kv-cache-gib 6 \
      --steps 24 --deadline-s "$(deadline)";;
  optim) run optim 60 "$PY" -m bench.gpu.optimizer --out "$KEEP" --shape qwen2.5-7b;;
  *) echo "unknown step $s" | tee -a "$OUT/$SUMMARY";;
esac; cp "$KEEP"/*.json "$OUT"/ 2>/dev/null; done
grep -hE "^\[|summary:|step [0-9]+ ends|engine.* up|passed|failed|Error|skipping" "$LOG" | grep -v WARNING | tail -60
