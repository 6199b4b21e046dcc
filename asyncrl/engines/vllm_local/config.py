"""How the in-process vLLM engine is built: ``VLLMEngineConfig`` and the ``AsyncEngineArgs`` it becomes.

Start-up on a GPU (``python -m bench.gpu.startup_probe`` splits it into phases): with ``enforce_eager=False``
vLLM compiles the model with torch.compile (cached under ``VLLM_CACHE_ROOT``: a second start on the same host
mostly loads it) and captures a CUDA graph per batch size. What a user can skip, fastest first:
``enforce_eager=True`` skips both (decoding is then launch-bound: slow for small models);
``torch_compile=False`` keeps CUDA graphs, as full graphs of the decode step, without compiling anything;
``cudagraph_capture_sizes`` captures fewer batch sizes (vLLM's default is a few dozen, up to 512).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError

WORKER_EXTENSION = "asyncrl.engines.vllm_local.worker_ext.AsyncRLWorkerExtension"  # loaded by name in workers
EXECUTOR_QUALNAME = "asyncrl.engines.vllm_local.executor.NappingReadersExecutor"  # loaded by name in EngineCore
WEIGHT_TRANSFERS = ("auto", "files", "cuda_ipc")
SLEEP_LEVELS = (0, 1, 2)


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """How the in-process vLLM engine is built."""

    model: str  # local model directory (config.json, tokenizer and *.safetensors)
    dtype: str = "auto"  # weights dtype in the engine ("auto" = the checkpoint's)
    max_model_len: int = 256  # prompt + completion tokens per sequence
    max_num_seqs: int = 64  # sequences scheduled at once
    kv_cache_gib: float = 1.0  # KV cache size (CPU: VLLM_CPU_KVCACHE_SPACE; GPU: kv_cache_memory_bytes)
    gpu_memory_utilization: float = 0.3  # GPU only, used when kv_cache_gib <= 0
    enforce_eager: bool = True  # skip torch.compile / CUDA graphs (fast start, tiny models)
    # With enforce_eager=False: False skips torch.compile (compilation mode 0) and captures full CUDA graphs of
    # the decode step only (cudagraph_mode FULL_DECODE_ONLY): most of the graphs' speed without the compile time.
    torch_compile: bool = True
    # With enforce_eager=False: the batch sizes CUDA graphs are captured for (None: vLLM's default list).
    # Fewer sizes capture faster; a batch between two sizes runs padded to the next one.
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    seed: int = 0
    # "auto": cuda_ipc on a CUDA GPU, files elsewhere. cuda_ipc keeps one extra copy of the weights in the
    # engine's GPU memory (the shadows) and needs the learner on the same host.
    weight_transfer: str = "auto"
    # Whether vLLM's internal queue readers spin for a second after each message (vLLM's default, True) or nap
    # between checks (False, see ``executor``). None: nap on CPU, where the spinning takes a core from the
    # learner; vLLM's own choice elsewhere.
    busy_wait: bool | None = None
    # vLLM sleep mode (GPU), for a learner that shares the GPU and trains while nothing generates (the
    # synchronous pipeline, ``VLLMEngine.sleep``). vLLM's levels: 1 copies the weights to host memory and frees
    # them and the KV cache; 2 frees both and keeps nothing, so the engine can only wake with a full weight
    # update. 0: off (vLLM's memory pool is then not used). On CPU sleeping only pauses the engine.
    sleep: int = 0
    # More AsyncEngineArgs fields, passed as is; a ``compilation_config`` dict is merged over the one that
    # ``torch_compile`` and ``cudagraph_capture_sizes`` make.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ConfigError("VLLMEngineConfig.model", f"model directory {self.model!r} does not exist")
        if not (Path(self.model) / "config.json").is_file():
            raise ConfigError("VLLMEngineConfig.model", f"{self.model!r} has no config.json")
        if self.weight_transfer not in WEIGHT_TRANSFERS:
            raise ConfigError("VLLMEngineConfig.weight_transfer",
                              f"must be one of {WEIGHT_TRANSFERS}, got {self.weight_transfer!r}")
        if not (self.busy_wait is None or isinstance(self.busy_wait, bool)):
            raise ConfigError("VLLMEngineConfig.busy_wait", f"must be None, True or False, got {self.busy_wait!r}")
        if self.sleep not in SLEEP_LEVELS or isinstance(self.sleep, bool):
            raise ConfigError("VLLMEngineConfig.sleep", f"must be one of {SLEEP_LEVELS}, got {self.sleep!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not sizes or any(not isinstance(n, int) or n <= 0 for n in sizes)):
            raise ConfigError("VLLMEngineConfig.cudagraph_capture_sizes",
                              f"must be None or positive batch sizes, got {sizes!r}")
        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"VLLMEngineConfig.{name}", f"must be a positive integer, got {value!r}")

    def uses_cuda_ipc(self) -> bool:
        return self.weight_transfer == "cuda_ipc" or (self.weight_transfer == "auto" and not is_cpu_platform())


def whole_prompts_only() -> bool:
    """Whether vLLM must schedule whole prompts (no chunked prefill), for the engine we run and the servers we
    start alike. True on vLLM CPU: every request is seeded, and it cannot rewind a seeded generator after a
    prompt split over two scheduler steps, so the engine core dies ("CPU Generator does not use offset")."""
    return is_cpu_platform()


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_args(cfg: VLLMEngineConfig) -> Any:
    """The ``AsyncEngineArgs`` for ``cfg`` (``cfg.extra`` last, so it can override anything)."""
    from vllm import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(
        model=cfg.model, dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager, seed=cfg.seed,
        # Behaviour log-probs must be those of the distribution actually sampled (after temperature).
        logprobs_mode="processed_logprobs",
        use_tqdm_on_load=False,  # a progress bar per weight sync is noise
        worker_extension_cls=WORKER_EXTENSION,  # reload that keeps tied weights tied
    )
    cpu = is_cpu_platform()
    if (cpu if cfg.busy_wait is None else not cfg.busy_wait):  # nap: asyncrl's executor
        kwargs["distributed_executor_backend"] = EXECUTOR_QUALNAME
    if cpu:
        # vLLM CPU reads its KV size from the environment; without it, it takes most of the RAM.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(cfg.kv_cache_gib))))
    else:
        # The learner usually lives in this process and has touched CUDA already: forked workers can't.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if cfg.kv_cache_gib > 0:  # a KV size in bytes also skips the memory-utilisation profiling
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if whole_prompts_only():
        kwargs["enable_chunked_prefill"] = False
    if cfg.sleep and not cpu:  # vLLM's CPU platform has no sleep mode (and refuses the flag)
        kwargs["enable_sleep_mode"] = True
    compilation = compilation_config(cfg)
    extra = dict(cfg.extra)
    if isinstance(extra.get("compilation_config"), dict):
        compilation = {**compilation, **extra.pop("compilation_config")}
    if compilation:
        kwargs["compilation_config"] = compilation
    kwargs.update(extra)
    return AsyncEngineArgs(**kwargs)


def compilation_config(cfg: VLLMEngineConfig) -> dict[str, Any]:
    """The ``compilation_config`` fields ``torch_compile`` and ``cudagraph_capture_sizes`` ask for ({}: vLLM's
    defaults). Nothing under ``enforce_eager``, which turns both off."""
    if cfg.enforce_eager:
        return {}
    out: dict[str, Any] = {}
    if not cfg.torch_compile:
        out.update(mode=0, cudagraph_mode="FULL_DECODE_ONLY")
    if cfg.cudagraph_capture_sizes is not None:
        out["cudagraph_capture_sizes"] = sorted(set(cfg.cudagraph_capture_sizes))
    return out
