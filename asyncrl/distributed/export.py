"""Export a sharded (DCP) checkpoint as a Hugging Face model directory, in one process:

    python -m asyncrl.distributed.export CKPT_DIR --model-dir START_MODEL_DIR --out HF_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from asyncrl.distributed.checkpoint import export_hf


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Export a sharded (DCP) checkpoint as a Hugging Face model.")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--model-dir", type=Path, required=True, help="the model the run started from (config)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    args = p.parse_args(argv)
    print(export_hf(args.checkpoint, args.model_dir, args.out, getattr(torch, args.dtype) if args.dtype else None))


if __name__ == "__main__":
    main()
