"""Time vLLM engine start-up on a model directory and report where it spends its time (GPU diagnosis).

    python -m bench.gpu.startup_probe MODEL_DIR [--attn BACKEND] [--compile]      (from the repository root)

For stacks of a slow start, put ``bench/gpu/stackdump`` on ``PYTHONPATH`` with ``STACKDUMP_DIR`` set.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time


async def probe(args: argparse.Namespace) -> None:
    from asyncrl.config import SamplingConfig
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    extra = {}
    if args.attn:
        extra["attention_backend"] = args.attn
    cfg = VLLMEngineConfig(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
                           max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_gib,
                           enforce_eager=not args.compile, extra=extra)
    t0 = time.perf_counter()
    engine = await VLLMEngine.start(cfg)
    print(f"STARTUP_S {time.perf_counter() - t0:.1f}", flush=True)
    try:
        t1 = time.perf_counter()
        samples = await engine.generate((1, 2, 3, 4), SamplingConfig(n=8, max_tokens=32, ignore_eos=True), "p")
        print(f"FIRST_GENERATE_S {time.perf_counter() - t1:.2f} tokens {sum(len(s.token_ids) for s in samples)}")
    finally:
        await engine.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--attn", default="")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=8.0)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    asyncio.run(probe(args))


if __name__ == "__main__":
    main()
