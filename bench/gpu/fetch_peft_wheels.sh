#!/usr/bin/env bash
# PEFT for the LoRA runs on the H200: its image has torch, transformers and accelerate but no peft and no package
# registry. The pure-Python wheel for its Python 3.12, pinned as in constraints/cpu.txt, downloaded here into
# .cache/gpu-peft (~0.5 MiB); bench/gpu/run_lora.sh puts it on the path ($PEFT_WHEELS).
# Usage, from the project root:  bash bench/gpu/fetch_peft_wheels.sh
set -euo pipefail
mkdir -p .cache/gpu-peft
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .cache/gpu-peft \
  peft==0.21.2
ls -l .cache/gpu-peft
