"""Where the engine's start-up goes, phase by phase, cold and warm, and what each start-up option costs in decode
speed (GPU). Writes ``startup_probe_<gpu>.json`` into ``--out``.

    python -m bench.gpu.startup_probe MODEL_DIR                       # graphs cold+warm, nocompile, eager
    python -m bench.gpu.startup_probe MODEL_DIR --variants eager      # one variant, cold only

Each start runs in a fresh child process (``--child``) with vLLM logging at INFO; this parent stamps every line
of its output (and of the engine processes it starts) with the time it arrived, and reads the phases off vLLM's
own log lines: model load (``Model loading took``), torch.compile (Dynamo transform + Inductor compile, or the
load of cached graphs), CUDA graph capture (``Graph capturing finished``), and the rest of vLLM's engine
initialisation (memory profiling, KV cache allocation, warm-up). ``spawn_s`` is from the start call until the
model load began (EngineCore and worker processes starting, importing vLLM and torch, CUDA init);
``after_init_s`` from vLLM's "init engine" line until ``VLLMEngine.start`` returned.

Variants map to ``VLLMEngineConfig`` options: ``graphs`` (enforce_eager=False: torch.compile + CUDA graphs, vLLM's
default), ``nocompile`` (torch_compile=False: full decode graphs, nothing compiled), ``fewgraphs`` (graphs for
9 batch sizes instead of vLLM's few dozen), ``eager`` (enforce_eager=True). A variant's cold start uses an
empty compile cache (``VLLM_CACHE_ROOT``, Triton and Inductor caches in a fresh directory); ``--warm`` variants
start a second time on the cache the first left (what a second run on the same host gets). After each start
the child decodes ``--decode-seqs`` x ``--decode-tokens`` tokens (ignore_eos) and reports tokens/s.

For stacks of a start that hangs, put ``bench/gpu/stackdump`` on ``PYTHONPATH`` with ``STACKDUMP_DIR`` set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

VARIANTS = {
    "graphs": dict(enforce_eager=False),
    "nocompile": dict(enforce_eager=False, torch_compile=False),
    "fewgraphs": dict(enforce_eager=False, cudagraph_capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)),
    "eager": dict(enforce_eager=True),
}
# vLLM 0.26-0.32 log lines -> the phase (seconds, first number captured) they report.
PATTERNS = {
    "load_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "weights_s": r"Loading weights took ([\d.]+) seconds",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "inductor_s": r"Compiling a graph for .* takes ([\d.]+) s",
    "compile_cache_load_s": r"Directly load the compiled graph\(s\) .* took ([\d.]+) s",
    "compile_total_s": r"torch\.compile took ([\d.]+) s in total",
    "profile_run_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "kv_cache_gib": r"Available KV cache memory: ([\d.]+) GiB",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--variants", default="graphs,nocompile,eager", help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--warm", default="graphs", help="variants also started a second time on a warm cache")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=16.0)
    p.add_argument("--attn", default="", help="attention_backend (vLLM's choice if empty)")
    p.add_argument("--decode-seqs", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--timeout", type=int, default=240, help="seconds per start")
    p.add_argument("--out", type=Path, default=None, help="result directory (default bench/results)")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------ child


async def child(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    from asyncrl.config import SamplingConfig
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    import vllm  # noqa: F401  (timed: the import is part of what a user waits for)

    print(f"PROBE import_s {time.perf_counter() - t0:.2f}", flush=True)
    extra = {"attention_backend": args.attn} if args.attn else {}
    cfg = VLLMEngineConfig(model=str(args.model), dtype="bfloat16", max_model_len=args.max_model_len,
                           max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_gib, extra=extra,
                           **VARIANTS[args.child])
    print("PROBE start_called", flush=True)
    t1 = time.perf_counter()
    engine = await VLLMEngine.start(cfg)
    print(f"PROBE started start_s {time.perf_counter() - t1:.2f}", flush=True)
    try:
        params = SamplingConfig(n=1, max_tokens=8, ignore_eos=True)
        t2 = time.perf_counter()
        await engine.generate((1, 2, 3, 4), params, "first")
        print(f"PROBE first_request_s {time.perf_counter() - t2:.2f}", flush=True)
        params = SamplingConfig(n=args.decode_seqs, max_tokens=args.decode_tokens, ignore_eos=True)
        t3 = time.perf_counter()
        samples = await engine.generate(tuple(range(5, 69)), params, "decode")
        tokens = sum(len(s.token_ids) for s in samples)
        print(f"PROBE decode_tokens_per_s {tokens / (time.perf_counter() - t3):.1f}", flush=True)
    finally:
        await engine.close()


# ----------------------------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, variant: str, cache: Path) -> dict[str, Any]:
    """One start in a child process; every output line stamped with its arrival time."""
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO", VLLM_CACHE_ROOT=str(cache / "vllm"),
               TRITON_CACHE_DIR=str(cache / "triton"), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "bench.gpu.startup_probe", str(args.model), "--child", variant,
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--kv-gib", str(args.kv_gib), "--decode-seqs", str(args.decode_seqs),
           "--decode-tokens", str(args.decode_tokens)] + (["--attn", args.attn] if args.attn else [])
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(args.timeout, proc.kill)  # a silent hang must not block the read below
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
    out = phases(lines)
    out.update(variant=variant, rc=rc, wall_s=time.perf_counter() - t0)
    if rc:
        out["tail"] = [line for _, line in lines[-25:]]
    return out


def phases(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """The phases read off one child's stamped output (see the module docstring)."""
    out: dict[str, Any] = {}
    at: dict[str, float] = {}
    for t, line in lines:
        for key, pattern in PATTERNS.items():
            m = re.search(pattern, line)
            if m and key not in out:
                out[key], at[key] = float(m.group(1)), t
        m = re.match(r"PROBE (\w+)(?: ([\d.]+))?(?: (\w+) ([\d.]+))?", line)
        if m:
            at[m.group(1)] = t
            if m.group(2):
                out[m.group(1)] = float(m.group(2))
            if m.group(3):
                out[m.group(3)] = float(m.group(4))
    if "start_called" in at and "load_s" in at:
        out["spawn_s"] = at["load_s"] - out["load_s"] - at["start_called"]
    if "init_engine_s" in at and "started" in at:
        out["after_init_s"] = at["started"] - at["init_engine_s"]
    if "init_engine_s" in out:
        known = sum(out.get(k, 0.0) for k in ("dynamo_s", "inductor_s", "compile_cache_load_s", "graph_capture_s"))
        out["profile_kv_warmup_s"] = max(0.0, out["init_engine_s"] - known)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        asyncio.run(child(args))
        return 0
    from bench import common

    common.set_env()
    result = common.Result("startup_probe", args, argv, module="bench.gpu.startup_probe")
    runs = []
    warm = set(args.warm.split(","))
    for variant in args.variants.split(","):
        with tempfile.TemporaryDirectory(prefix=f"probe-{variant}-") as cache:
            for attempt in ("cold", "warm") if variant in warm else ("cold",):
                r = run_child(args, variant, Path(cache))
                r["cache"] = attempt
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
                result.write({"runs": runs})  # after every start: a probe cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
