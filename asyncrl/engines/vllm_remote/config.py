"""How to reach one vLLM server, when to call it dead, and how weights reach it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator

from asyncrl.config_base import PathStr, PositiveInt, Seconds, config, require
from asyncrl.engines.lora.transport import LoraServingConfig
from asyncrl.engines.protocols import BehaviourPrecision
from asyncrl.errors import ConfigError


@config
class NcclTransportConfig:
    """Where the trainer side of vLLM's NCCL weight-transfer group lives."""

    master_port: Annotated[int, Field(strict=True, gt=0, lt=65536, description=(
        "free TCP port for the group's rendezvous store, hosted by this (trainer) process"))]
    master_address: Annotated[str, Field(min_length=1, description=(
        "this host, as the server's workers reach it"))] = "127.0.0.1"
    device: Annotated[str, Field(pattern=r"^cuda", description=(
        "the trainer's GPU, from which weights are broadcast (not one the server uses)"))] = "cuda:0"
    init_timeout_s: Annotated[Seconds, Field(description=(
        "group set-up (the workers join it inside /init_weight_transfer_engine)"))] = 300.0


@config
class RemoteEngineConfig:
    """How to reach one vLLM server. Only values: the directories are checked when the engine connects
    (``check_paths``)."""

    base_url: Annotated[str, Field(description=(
        "e.g. 'http://127.0.0.1:8000' (without /v1; a trailing slash is dropped)"))]
    model: Annotated[str, Field(min_length=1, description=(
        "the name the server serves the model under (its --served-model-name, default its --model)"))]
    model_dir: Annotated[PathStr, Field(description=(
        "local checkpoint of the served model: parameter manifest for validating updates, and the weights "
        "restored when a reload fails before any update succeeded"))]
    request_timeout_s: Annotated[Seconds, Field(description=(
        "control calls (pause, resume, reload...); streams have no total timeout"))] = 120.0
    health_timeout_s: Annotated[Seconds, Field(description="one GET /health probe")] = 5.0
    health_failures: Annotated[PositiveInt, Field(description=(
        "the server is declared dead only after this many probes in a row failed (each given "
        "health_timeout_s, health_retry_s apart): one slow answer from a loaded machine is not a death"))] = 3
    health_retry_s: Annotated[Seconds, Field(description="pause between two failed health probes")] = 1.0
    health_check_interval_s: Annotated[Seconds, Field(description=(
        "a stream or a ``wait`` pause silent this long triggers a probe (a paused server is silent on purpose; "
        "a dead one is not)"))] = 5.0
    api_key: Annotated[str | None, Field(min_length=1, description=(
        "sent as 'Authorization: Bearer ...' when the server runs with --api-key"))] = None
    staging_dir: Annotated[PathStr | None, Field(description=(
        "where updates are written for the server to read (same machine); None = /dev/shm when writable, "
        "else the temp dir"))] = None
    lora: Annotated[LoraServingConfig | None, Field(description=(
        "the server serves LoRA adapters on the frozen base (``engines.lora.server.lora_server_args``): "
        "publications carry the adapter alone and requests name it. None: publications replace every weight"))] = None
    nccl: Annotated[NcclTransportConfig | None, Field(description=(
        "publish by NCCL broadcast from this process's GPU (the server runs with --weight-transfer-config "
        "'{\"backend\": \"nccl\"}'); None: staged files the server reloads (same machine)"))] = None
    precision: Annotated[BehaviourPrecision | None, Field(description=(
        "what the server samples in, as it was started (vLLM does not report it): e.g. "
        "{dtype: 'bfloat16', quantization: 'fp8'} for FP8 rollouts beside a bf16 learner. Start the server with "
        "``server_precision_args(precision)`` so both say the same. None: unknown, nothing checked"))] = None

    @model_validator(mode="after")
    def _one_transport(self) -> RemoteEngineConfig:
        require(self.lora is None or self.nccl is None, self, "lora",
                "adapters are loaded from files by the server: leave nccl unset")
        return self

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str) -> str:
        url = urlparse(value)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"must be an http(s) URL, got {value!r}")
        return value.rstrip("/")


def check_paths(cfg: RemoteEngineConfig) -> None:
    """Refuse directories that cannot serve; called where the engine connects (it reads the disk)."""
    if not Path(cfg.model_dir).is_dir() or not any(Path(cfg.model_dir).glob("*.safetensors")):
        raise ConfigError("RemoteEngineConfig.model_dir",
                          f"{cfg.model_dir!r} is not a directory holding *.safetensors files")
    if cfg.staging_dir is not None and not Path(cfg.staging_dir).is_dir():
        raise ConfigError("RemoteEngineConfig.staging_dir", f"{cfg.staging_dir!r} is not a directory")
