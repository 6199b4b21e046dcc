"""The narrow engine Protocol the rest of asyncrl talks to.

vLLM's in-process ``AsyncLLM`` sits behind ``VLLMEngine``; a remote vLLM server behind ``RemoteVLLMEngine``;
tests and benchmarks use ``FakeEngine``. Nothing outside ``asyncrl/engines`` imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import zlib

import torch

from asyncrl.config import SamplingConfig
from asyncrl.types import PauseMode, Sample


class EngineError(RuntimeError):
    """The engine failed or died. ``engine`` names which one."""

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(f"engine {engine}: {message}")
        self.engine = engine


class PromptRejected(ValueError):
    """The engine refused a prompt (too long for its context, empty...). The group can be dropped."""


class WeightUpdateError(RuntimeError):
    """A weight update was refused or failed. The engine kept (or was restored to) its previous weights
    and its version did not change."""


def request_seed(seed: int | None, request_id: str) -> int | None:
    """A per-request sampling seed: reproducible for a run seed, different for every request (a seed per
    sample index alone would give every group the same random stream)."""
    return None if seed is None else (seed * 1_000_003 + zlib.crc32(request_id.encode())) % 2**31


@dataclass(frozen=True, slots=True)
class StagedInEngine:
    """``WeightUpdate.staged`` when the engine already holds the new weights beside the live ones (CUDA IPC
    path): loading them under the pause is a device copy."""

    version: int


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """New policy weights to publish.

    ``tensors`` maps checkpoint-format parameter names (as in the model's ``state_dict``) to tensors; a
    full update must name every parameter the engine's model has.
    """

    version: int  # the version these weights become once loaded
    tensors: Mapping[str, torch.Tensor]
    staged: Path | StagedInEngine | None = None  # set by ``prepare_update``: validated, ready to load


@runtime_checkable
class Engine(Protocol):
    """What producers and the learner need from an inference engine."""

    name: str  # for logs and errors

    @property
    def version(self) -> int:
        """The weight version new tokens are sampled with. Read by producers to tag rollouts."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt + completion tokens the engine accepts. Producers drop prompts that leave no room."""
        ...

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        """Sample ``n`` (default ``params.n``) completions. Called by producers, many at once.

        Each sample carries per-token behaviour log-probs and version spans. Samples cut by an ``abort``
        pause come back with ``FinishReason.ABORT`` and the tokens produced so far. Cancelling the call
        aborts its requests in the engine.
        """
        ...

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Stop sampling before a weight update. Called by the learner's weight sync, under its lock."""
        ...

    async def update_weights(self, update: WeightUpdate) -> None:
        """Load new weights while paused, then report ``update.version`` for every new token.

        All-or-nothing: on failure the engine keeps its previous weights and version and this raises
        ``WeightUpdateError``.
        """
        ...

    async def resume(self) -> None:
        """Continue sampling after ``pause``. Always called, even when the update failed."""
        ...

    async def check_alive(self) -> None:
        """Raise ``EngineError`` if the engine (or its process) is gone. Polled by the pipeline's watchdog."""
        ...

    async def close(self) -> None:
        """Shut down and release processes. Idempotent."""
        ...


@runtime_checkable
class PreparesUpdates(Protocol):
    """Engines that can do the slow part of an update (checks, serialisation) before generation pauses,
    so the pause covers only the load itself. ``WeightSync`` uses this when the engine offers it."""

    async def prepare_update(self, update: WeightUpdate) -> WeightUpdate:
        """Validate and stage ``update``; raises ``WeightUpdateError`` with nothing applied."""
        ...

    def discard_update(self, update: WeightUpdate) -> None:
        """Drop a prepared update that will not be loaded (the sync failed before loading it)."""
        ...
