#!/usr/bin/env bash
# What vLLM 0.26 imports to quantize (any `quantization=`, FP8 included) and the H200 image lacks: compressed-tensors
# and its logger, pure-Python wheels pinned as in constraints/cpu.txt (vLLM 0.26 pins the same compressed-tensors),
# downloaded here into .cache/gpu-fp8 (~0.3 MiB). On the GPU host, unpack them onto the path before the run:
#   for w in .cache/gpu-fp8/*.whl; do python3 -m zipfile -e "$w" /tmp/fp8-site; done; export PYTHONPATH=/tmp/fp8-site:$PYTHONPATH
# Usage, from the project root:  bash bench/gpu/fetch_fp8_wheels.sh
set -euo pipefail
mkdir -p .cache/gpu-fp8
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .cache/gpu-fp8 \
  compressed-tensors==0.17.0 loguru==0.7.3
ls -l .cache/gpu-fp8
