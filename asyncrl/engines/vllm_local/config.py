"""How the in-process vLLM engine is built: ``VLLMEngineConfig`` and the ``AsyncEngineArgs`` it becomes."""

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
    seed: int = 0
    # "auto": cuda_ipc on a CUDA GPU, files elsewhere. cuda_ipc keeps one extra copy of the weights in the
    # engine's GPU memory (the shadows) and needs the learner on the same host.
    weight_transfer: str = "auto"
    # Whether vLLM's internal queue readers spin for a second after each message (vLLM's default, True) or nap
    # between checks (False, see ``executor``). None: nap on CPU, where the spinning takes a core from the
    # learner; vLLM's own choice elsewhere.
    busy_wait: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more AsyncEngineArgs fields, passed as is

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
        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"VLLMEngineConfig.{name}", f"must be a positive integer, got {value!r}")

    def uses_cuda_ipc(self) -> bool:
        return self.weight_transfer == "cuda_ipc" or (self.weight_transfer == "auto" and not is_cpu_platform())


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
    kwargs.update(cfg.extra)
    return AsyncEngineArgs(**kwargs)
