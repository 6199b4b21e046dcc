"""How the in-process vLLM engine is built: ``VLLMEngineConfig`` and the ``AsyncEngineArgs`` it becomes.

Start-up on a GPU (``python -m bench.gpu.startup_probe`` splits it into phases): with ``enforce_eager=False``
vLLM compiles the model with torch.compile (cached under ``VLLM_CACHE_ROOT``: a second start on the same host
mostly loads it) and captures a CUDA graph per batch size. What a user can skip, fastest first:
``enforce_eager=True`` skips both (decoding is then launch-bound: slow for small models);
``torch_compile=False`` keeps CUDA graphs, as full graphs of the decode step, without compiling anything;
``cudagraph_capture_sizes`` captures fewer batch sizes (vLLM's default is a few dozen, up to 512).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from asyncrl.config_base import Flag, PathStr, PositiveInt, config, require
from asyncrl.engines.lora.transport import LoraServingConfig
from asyncrl.errors import ConfigError

WORKER_EXTENSION = "asyncrl.engines.vllm_local.worker_ext.AsyncRLWorkerExtension"  # loaded by name in workers
EXECUTOR_QUALNAME = "asyncrl.engines.vllm_local.executor.NappingReadersExecutor"  # loaded by name in EngineCore


class WeightTransfer(str, enum.Enum):
    """How published weights reach the engine's workers."""

    AUTO = "auto"  # cuda_ipc on a CUDA GPU, files elsewhere
    FILES = "files"  # safetensors files the workers read
    CUDA_IPC = "cuda_ipc"  # shared CUDA memory (learner on the same host; one extra weight copy in the engine)


@config
class VLLMEngineConfig:
    """How the in-process vLLM engine is built. Only values: the model directory is checked, and the
    environment vLLM reads is applied, when the engine starts (``check_model``, ``engine_env``)."""

    model: Annotated[PathStr, Field(description=(
        "local model directory (config.json, tokenizer and *.safetensors)"))]
    dtype: Annotated[str, Field(description=(
        "weights dtype in the engine ('auto': vLLM's choice, which serves a float32 checkpoint in bfloat16; set "
        "the learner's precision: grpo_pipeline refuses a mismatch)"))] = "auto"
    max_model_len: Annotated[PositiveInt, Field(description="prompt + completion tokens per sequence")] = 256
    max_num_seqs: Annotated[PositiveInt, Field(description="sequences scheduled at once")] = 64
    kv_cache_gib: Annotated[float, Field(strict=True, allow_inf_nan=False, description=(
        "KV cache size (CPU: VLLM_CPU_KVCACHE_SPACE, whole GiB; GPU: kv_cache_memory_bytes; <= 0 on GPU: "
        "sized by gpu_memory_utilization)"))] = 1.0
    gpu_memory_utilization: Annotated[float, Field(strict=True, gt=0, le=1, description=(
        "GPU only, used when kv_cache_gib <= 0"))] = 0.3
    enforce_eager: Annotated[Flag, Field(description=(
        "skip torch.compile / CUDA graphs (fast start, tiny models)"))] = True
    torch_compile: Annotated[Flag, Field(description=(
        "with enforce_eager=False: False skips torch.compile (compilation mode 0) and captures full CUDA "
        "graphs of the decode step only (cudagraph_mode FULL_DECODE_ONLY): most of the graphs' speed without "
        "the compile time"))] = True
    cudagraph_capture_sizes: Annotated[tuple[PositiveInt, ...] | None, Field(min_length=1, description=(
        "with enforce_eager=False: the batch sizes CUDA graphs are captured for (None: vLLM's default list). "
        "Fewer sizes capture faster; a batch between two sizes runs padded to the next one"))] = None
    seed: Annotated[int, Field(strict=True, description="the engine's sampling seed")] = 0
    weight_transfer: Annotated[WeightTransfer, Field(description=(
        "how weights reach the workers; cuda_ipc keeps one extra copy of the weights in the engine's GPU "
        "memory (the shadows) and needs the learner on the same host"))] = WeightTransfer.AUTO
    busy_wait: Annotated[Flag | None, Field(description=(
        "whether vLLM's internal queue readers spin for a second after each message (vLLM's default, True) "
        "or nap between checks (False, see ``executor``). None: nap on CPU, where the spinning takes a core "
        "from the learner; vLLM's own choice elsewhere"))] = None
    sleep: Annotated[int, Field(strict=True, ge=0, le=2, description=(
        "vLLM sleep mode level (GPU), for a learner that shares the GPU and trains while nothing generates "
        "(the synchronous pipeline, ``VLLMEngine.sleep``): 1 copies the weights to host memory and frees them "
        "and the KV cache; 2 frees both and keeps nothing, so the engine can only wake with a full weight "
        "update. 0: off (vLLM's memory pool is then not used). On CPU sleeping only pauses the engine"))] = 0
    quantization: Annotated[str | None, Field(min_length=1, description=(
        "the weights' quantization method, by vLLM's name ('fp8'...; checked against vLLM's list at start): the "
        "engine then samples in coarser numerics than the learner on purpose, and grpo_pipeline accepts and "
        "reports the pairing (the importance weights correct the gap). None: none asked for (a quantized "
        "checkpoint still declares its own, and the engine reports it)"))] = None
    kv_cache_dtype: Annotated[str | None, Field(min_length=1, description=(
        "the KV cache's dtype, by vLLM's name ('fp8'...; checked at start), declared like ``quantization``. "
        "None: the weights' dtype (vLLM's 'auto')"))] = None
    lora: Annotated[LoraServingConfig | None, Field(description=(
        "serve LoRA adapters on the frozen base model: publications then carry the adapter alone "
        "(``engines.lora.transport``). None: publications replace every weight"))] = None
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] | None, Field(description=(
        "vLLM's log level, in this process (the 'vllm' logger) and in the processes it spawns (their "
        "VLLM_LOGGING_LEVEL); its INFO lines are a hundred or so per start. None: vLLM's own setting. A "
        "VLLM_LOGGING_LEVEL set in the environment wins over this"))] = "WARNING"
    extra: Annotated[dict[str, Any], Field(description=(
        "more AsyncEngineArgs fields, passed as is; a ``compilation_config`` dict is merged over the one that "
        "``torch_compile`` and ``cudagraph_capture_sizes`` make"))] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _rules(self) -> VLLMEngineConfig:
        require(self.lora is None or not self.sleep, self, "lora",
                "LoRA serving and sleep mode do not combine: an adapter publication is cheap enough to need no sleep")
        require(self.lora is None or self.weight_transfer != WeightTransfer.CUDA_IPC, self, "weight_transfer",
                "with lora set, publications carry adapters (engines.lora.transport): leave weight_transfer at auto")
        return self

    def uses_cuda_ipc(self) -> bool:
        return self.weight_transfer == WeightTransfer.CUDA_IPC or (
            self.weight_transfer == WeightTransfer.AUTO and not is_cpu_platform())


def check_model(cfg: VLLMEngineConfig) -> None:
    """Refuse a model directory that cannot be loaded; called where the engine starts (it reads the disk)."""
    if not Path(cfg.model).is_dir():
        raise ConfigError("VLLMEngineConfig.model", f"model directory {cfg.model!r} does not exist")
    if not (Path(cfg.model) / "config.json").is_file():
        raise ConfigError("VLLMEngineConfig.model", f"{cfg.model!r} has no config.json")


def engine_env(cfg: VLLMEngineConfig, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables vLLM reads at start-up that ``cfg`` decides, less those ``environ`` sets already (the
    user's choice wins). The start-up applies them for its duration (``scoped_env``)."""
    if is_cpu_platform():
        # vLLM CPU reads its KV size from the environment; without it, it takes most of the RAM.
        wanted = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(cfg.kv_cache_gib)))}
    else:
        # The learner usually lives in this process and has touched CUDA already: forked workers can't.
        wanted = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    if cfg.log_level is not None:  # read by the engine-core processes as they import vLLM
        wanted["VLLM_LOGGING_LEVEL"] = cfg.log_level
    return {k: v for k, v in wanted.items() if k not in environ}


def set_vllm_log_level(cfg: VLLMEngineConfig, environ: Mapping[str, str] = os.environ) -> None:
    """Apply ``cfg.log_level`` to this process's 'vllm' logger (vLLM set it from VLLM_LOGGING_LEVEL when first
    imported, before any config was seen), unless the user chose a level through that variable. The level of
    a logger is process-wide: the last engine started sets it for all."""
    if cfg.log_level is not None and "VLLM_LOGGING_LEVEL" not in environ:
        logging.getLogger("vllm").setLevel(cfg.log_level)


def whole_prompts_only() -> bool:
    """Whether vLLM must schedule whole prompts (no chunked prefill), for the engine we run and the servers we
    start alike. True on vLLM CPU: every request is seeded, and it cannot rewind a seeded generator after a
    prompt split over two scheduler steps, so the engine core dies ("CPU Generator does not use offset")."""
    return is_cpu_platform()


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_args(cfg: VLLMEngineConfig) -> Any:
    """The ``AsyncEngineArgs`` for ``cfg`` (``cfg.extra`` last, so it can override anything). Pure: the
    environment it needs is ``engine_env``."""
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
    if not cpu:  # on CPU the KV size travels in the environment (``engine_env``)
        if cfg.kv_cache_gib > 0:  # a KV size in bytes also skips the memory-utilisation profiling
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if whole_prompts_only():
        kwargs["enable_chunked_prefill"] = False
    if cfg.sleep and not cpu:  # vLLM's CPU platform has no sleep mode (and refuses the flag)
        kwargs["enable_sleep_mode"] = True
    kwargs.update(quantization_args(cfg))
    if cfg.lora is not None:
        kwargs.update(enable_lora=True, max_lora_rank=cfg.lora.max_rank, max_loras=cfg.lora.max_loras,
                      max_cpu_loras=cfg.lora.max_cpu_loras)
    compilation = compilation_config(cfg)
    extra = dict(cfg.extra)
    if isinstance(extra.get("compilation_config"), dict):
        compilation = {**compilation, **extra.pop("compilation_config")}
    if compilation:
        kwargs["compilation_config"] = compilation
    kwargs.update(extra)
    return AsyncEngineArgs(**kwargs)


def quantization_args(cfg: VLLMEngineConfig) -> dict[str, Any]:
    """``quantization`` and ``kv_cache_dtype`` as AsyncEngineArgs fields, refused by field name where this vLLM
    does not know them. Whether the platform has kernels for them is vLLM's to say at start-up, except FP8
    weights on vLLM's CPU build: its start fails there with an error that names a kernel's signature, not the
    cause, so it is refused here instead."""
    import typing

    from vllm.config.cache import CacheDType
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.platforms import current_platform

    out: dict[str, Any] = {}
    if cfg.quantization is not None:
        if cfg.quantization not in QUANTIZATION_METHODS:
            raise ConfigError("VLLMEngineConfig.quantization", f"{cfg.quantization!r} is not one of vLLM's methods "
                                                               f"{sorted(QUANTIZATION_METHODS)}")
        if "fp8" in cfg.quantization and current_platform.is_cpu():
            raise ConfigError("VLLMEngineConfig.quantization", f"{cfg.quantization!r}: vLLM's CPU build has no FP8 "
                                                               "weight kernels; serve FP8 on a GPU")
        out["quantization"] = cfg.quantization
    if cfg.kv_cache_dtype is not None:
        known = [d for d in typing.get_args(CacheDType) if d != "auto"]
        if cfg.kv_cache_dtype not in known:
            raise ConfigError("VLLMEngineConfig.kv_cache_dtype", f"{cfg.kv_cache_dtype!r} is not one of vLLM's KV "
                                                                 f"cache dtypes {known}")
        out["kv_cache_dtype"] = cfg.kv_cache_dtype
    return out


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


_ENV_LOCK = threading.Lock()  # two start-ups in threads must not restore each other's variables midway


@contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment for the block (the processes it spawns inherit them),
    then put back what was there before."""
    with _ENV_LOCK:
        before = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, old in before.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
