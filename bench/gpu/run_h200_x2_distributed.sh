#!/usr/bin/env bash
# The distributed learner on two H200s of one host (vLLM importable): learner tokens/s at 2 ranks vs 1 on the
# Qwen2-0.5B shape, the paused publication from the sharded learner (0.5B and 1.5B shapes, NCCL into one vLLM
# server beside rank 1), and a 50-step asynchronous run. Writes distributed_h200x2.json into $OUT.
# Usage, from the repository root:  bash bench/gpu/run_h200_x2_distributed.sh [--learner-only]
source bench/gpu/common.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # shared GPUs: no NVLink multicast
step distributed 570 "$PY" -m bench.gpu.distributed --out "$OUT" "$@"
tail -5 "$OUT/distributed.log"
