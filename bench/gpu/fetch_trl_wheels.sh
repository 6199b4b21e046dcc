#!/usr/bin/env bash
# The pieces of TRL 1.16.0 the H200 image lacks (it has torch, transformers, accelerate, pyarrow, pandas, xxhash,
# but no trl, datasets, dill or multiprocess, and no package registry): pure-Python wheels for its Python 3.12,
# downloaded here into .cache/gpu-trl (~2 MiB), where bench/gpu/run_h200_trl.sh unpacks them ($TRL_WHEELS).
# Usage, from the project root:  bash bench/gpu/fetch_trl_wheels.sh
set -euo pipefail
mkdir -p .cache/gpu-trl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform any -d .cache/gpu-trl \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -l .cache/gpu-trl
