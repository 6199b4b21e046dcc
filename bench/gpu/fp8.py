"""FP8 rollouts against bf16 on one GPU, side by side in one run: decode tokens/s of the same engine serving the
same bf16 checkpoint in bf16 and in FP8 (vLLM's online quantization), and the pause of a full-weight publication
into each (the learner's bf16 weights, CUDA IPC, KEEP mode). Writes ``fp8_<gpu>.json`` into ``--out``.

    python -m bench.gpu.fp8 --shape qwen2-1.5b

The model is the countdown workload's randomly initialised Qwen2 shape (``bench.gpu.countdown build``), or its
planted policy for the 7-8B shapes (``bench.gpu.planted``): decode speed depends on the shape, not on what the
weights learned. The precisions alternate ``--rounds`` times, each
round starting both engines afresh, so drift on the host (clocks, other tenants) falls on both alike.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Result, parser
from bench.gpu import countdown

PRECISIONS = {"bf16": None, "fp8": "fp8"}  # name -> VLLMEngineConfig.quantization


def parse_args(argv: list[str] | None = None) -> Any:
    p = parser(__doc__)
    p.add_argument("--shape", default="qwen2-1.5b", help="a bench.gpu.countdown shape")
    p.add_argument("--seqs", type=int, default=256, help="sequences decoded at once")
    p.add_argument("--also-seqs", default=[], type=lambda text: [int(n) for n in text.split(",") if n.strip()],
                   help="more concurrencies to decode at on the same engines, comma-separated (FP8 weights save "
                        "bandwidth: they pay most where decode is bound by reading the weights, at few sequences)")
    p.add_argument("--tokens", type=int, default=512, help="tokens decoded per sequence (ignore_eos)")
    p.add_argument("--syncs", type=int, default=3, help="publications timed per engine")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=16.0)
    p.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    p.add_argument("--learner-on-host", action="store_true",
                   help="publish from the learner's weights in host memory: at 7B on 80 GiB the learner, its "
                        "snapshot, the engine's weights, their shadows and the KV cache do not fit together; the "
                        "copy to the device is staging, before the pause, so the pause is the same")
    return p.parse_args(argv)


async def one_engine(args: Any, model_dir: Path, quantization: str | None, learner: Any) -> dict[str, Any]:
    """Start an engine in one precision, decode, publish ``--syncs`` times; its figures."""
    import torch

    from asyncrl import SyncConfig, VersionClock, WeightSync
    from asyncrl.config import SamplingConfig
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig
    from asyncrl.engines.weights import state_dict_for_engine
    from asyncrl.types import PauseMode

    cfg = VLLMEngineConfig(model=str(model_dir), dtype="bfloat16", quantization=quantization,
                           max_model_len=64 * -(-(args.tokens + 64) // 64), max_num_seqs=args.seqs,
                           kv_cache_gib=args.kv_cache_gib, enforce_eager=args.enforce_eager, seed=0,
                           # With the KV size given in bytes, vLLM 0.26 still refuses to start unless this share
                           # of the GPU is free (its default, 0.92, failed with 125.6 of 139.8 GiB free on an H200;
                           # 0.8 with 62.6 of 79.2 GiB free on an H100, beside this process's CUDA context).
                           extra={"gpu_memory_utilization": 0.7})
    t0 = time.perf_counter()
    engine = await VLLMEngine.start(cfg)
    start_s = time.perf_counter() - t0
    if not args.learner_on_host:  # after the start: vLLM's start-up wants most of the GPU free, whatever KV size
        learner.cuda()
    torch.cuda.reset_peak_memory_stats()
    try:
        await engine.generate((10, 11, 12), SamplingConfig(n=1, max_tokens=8, seed=0), "warm-up")
        by_seqs = {n: await decode(engine, args.tokens, n) for n in args.also_seqs}
        tokens, decode_s = await decode(engine, args.tokens, args.seqs)
        sync = WeightSync(engine, VersionClock(engine.version), SyncConfig(mode=PauseMode.KEEP))
        pauses, prepares = [], []
        for _ in range(args.syncs):
            timing = await sync.publish(state_dict_for_engine(learner))
            pauses.append(timing.total_s)
            prepares.append(timing.prepare_s)
        free, total = torch.cuda.mem_get_info()
        return {"quantization": quantization, "precision": str(engine.behaviour_precision),
                "start_s": start_s, "decoded_tokens": tokens, "decode_s": decode_s,
                "decode_tokens_per_s": tokens / decode_s,
                "decode_tokens_per_s_by_seqs": {n: t / d for n, (t, d) in by_seqs.items()},
                "publication_pause_s": pauses,
                "publication_pause_median_s": statistics.median(pauses), "publication_prepare_s": prepares,
                "learner_on_host": args.learner_on_host, "bench_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "gpu_used_after_gib": (total - free) / 2**30}
    finally:
        learner.cpu()
        await engine.close()
        # The staged snapshots stay in torch's cache once freed (14.2 GiB at 7B): the next engine's start-up
        # counts them as used.
        gc.collect()
        torch.cuda.empty_cache()


async def decode(engine: Any, tokens: int, seqs: int) -> tuple[int, float]:
    """``seqs`` sequences of ``tokens`` tokens decoded at once: (tokens decoded, seconds)."""
    from asyncrl.config import SamplingConfig

    params = SamplingConfig(n=1, max_tokens=tokens, ignore_eos=True, seed=0)
    prompts = [tuple(range(10 + i % 50, 26 + i % 50)) for i in range(seqs)]
    t0 = time.perf_counter()
    done = await asyncio.gather(*(engine.generate(p, params, f"decode-{seqs}-{i}") for i, p in enumerate(prompts)))
    return sum(len(s.token_ids) for samples in done for s in samples), time.perf_counter() - t0


async def run(args: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="fp8-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        # Built in its own process: whatever the build leaves on the GPU goes with it, before an engine starts.
        # Shapes with an untied head (7-8B) are planted: the same tensors, drawn on the device, written faster.
        build = (["bench.gpu.planted", str(model_dir)] if countdown.is_planted(args.shape)
                 else ["bench.gpu.countdown", "build", str(model_dir)])
        subprocess.run([sys.executable, "-m", *build, "--shape", args.shape], check=True)
        learner = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = list(PRECISIONS) if r % 2 == 0 else list(reversed(PRECISIONS))
            rounds.append({name: await one_engine(args, model_dir, PRECISIONS[name], learner) for name in order})
            print(rounds[-1], flush=True)
    ratio = [r["fp8"]["decode_tokens_per_s"] / r["bf16"]["decode_tokens_per_s"] for r in rounds]
    pause = [r["fp8"]["publication_pause_median_s"] / r["bf16"]["publication_pause_median_s"] for r in rounds]
    by_seqs = {n: statistics.median(r["fp8"]["decode_tokens_per_s_by_seqs"][n]
                                    / r["bf16"]["decode_tokens_per_s_by_seqs"][n] for r in rounds)
               for n in args.also_seqs}
    return {"rounds": rounds, "decode_speedup_fp8_over_bf16": ratio, "decode_speedup_median_by_seqs": by_seqs,
            "decode_speedup_median": statistics.median(ratio), "pause_ratio_fp8_over_bf16": pause,
            "pause_ratio_median": statistics.median(pause)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = Result("fp8", args, argv, module="bench.gpu.fp8")
    out = asyncio.run(run(args))
    result.write(out, suffix=f"_{args.shape.replace('qwen2-', 'q').replace('.', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
