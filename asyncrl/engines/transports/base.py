"""The weight-transport role: how one engine takes new weights, in three phases.

An engine holds exactly one transport, chosen from its configuration when it starts, and its ``WeightTarget``
calls map onto the phases:

- ``stage`` (``prepare``, generation still running): check the update against what the engine serves and move
  it as close to the engine as possible (files in shared memory, shadow parameters, a packed buffer...), so
  that the pause covers only the load. Raises ``WeightUpdateError`` with nothing applied.
- ``load`` (under the pause): make the staged weights live. All-or-nothing: on failure the engine serves its
  previous weights (``WeightUpdateError``) or is declared undefined (``EngineError``); never half of each.
- ``release`` (once per staged update, loaded or not): let go of what ``stage`` held.

A transport reads the update's typed source (``updates.WeightSource``) and refuses, by name, a source it cannot
carry (an adapter into an engine serving full weights, say).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from asyncrl.engines.updates import WeightUpdate

__all__ = ["Transport", "WeightTransport"]


@runtime_checkable
class WeightTransport(Protocol):
    kind: str  # "files", "cuda_ipc", "sleep", "nccl", "lora": for logs and metrics

    async def stage(self, update: WeightUpdate) -> WeightUpdate:
        """The update with ``staged`` set (and possibly a cheaper ``source`` for the next engine of a pool to
        adopt). Cancellable: a cancelled stage holds nothing."""
        ...

    async def load(self, update: WeightUpdate) -> None:
        """Make a staged update live, under the engine's pause. The caller never cancels it half-way."""
        ...

    def release(self, update: WeightUpdate) -> None:
        """Free what ``stage`` held for ``update``."""
        ...

    async def close(self) -> None:
        """Free what the transport holds for itself (the last good weights, a communicator). Idempotent."""
        ...


class Transport(WeightTransport):
    """Defaults for the optional phases: nothing to release, nothing to close."""

    def release(self, update: WeightUpdate) -> None:
        pass

    async def close(self) -> None:
        pass
