"""How to reach one vLLM server, and when to call it dead."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from asyncrl.errors import ConfigError


@dataclass(frozen=True, slots=True)
class RemoteEngineConfig:
    """How to reach one vLLM server."""

    base_url: str  # e.g. "http://127.0.0.1:8000" (without /v1; a trailing slash is dropped)
    model: str  # the name the server serves the model under (its --served-model-name, default its --model)
    model_dir: str  # local checkpoint of the served model: parameter manifest for validating updates, and
    #                 the weights restored when a reload fails before any update succeeded
    request_timeout_s: float = 120.0  # control calls (pause, resume, reload...); streams have no total timeout
    health_timeout_s: float = 5.0  # one GET /health probe
    # The server is declared dead only after this many probes in a row failed (each given health_timeout_s,
    # health_retry_s apart): one slow answer from a loaded machine is not a death.
    health_failures: int = 3
    health_retry_s: float = 1.0
    health_check_interval_s: float = 5.0  # a stream or a ``wait`` pause silent this long triggers a probe
    #                                      (a paused server is silent on purpose; a dead one is not)
    api_key: str | None = None  # sent as "Authorization: Bearer ..." when the server runs with --api-key
    staging_dir: str | None = None  # where updates are written for the server to read (same machine);
    #                                 None = /dev/shm when writable, else the temp dir

    def __post_init__(self) -> None:
        url = urlparse(self.base_url) if isinstance(self.base_url, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError("RemoteEngineConfig.base_url", f"must be an http(s) URL, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/"))
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("RemoteEngineConfig.model", f"must be a non-empty string, got {self.model!r}")
        if not Path(self.model_dir).is_dir() or not any(Path(self.model_dir).glob("*.safetensors")):
            raise ConfigError("RemoteEngineConfig.model_dir",
                              f"{self.model_dir!r} is not a directory holding *.safetensors files")
        for name in ("request_timeout_s", "health_timeout_s", "health_retry_s", "health_check_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"RemoteEngineConfig.{name}", f"must be a positive number, got {value!r}")
        if not isinstance(self.health_failures, int) or isinstance(self.health_failures, bool) \
                or self.health_failures < 1:
            raise ConfigError("RemoteEngineConfig.health_failures",
                              f"must be an integer >= 1, got {self.health_failures!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ConfigError("RemoteEngineConfig.api_key", "must be None or a non-empty string")
        if self.staging_dir is not None and not Path(self.staging_dir).is_dir():
            raise ConfigError("RemoteEngineConfig.staging_dir", f"{self.staging_dir!r} is not a directory")
