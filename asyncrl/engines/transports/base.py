"""The weight-transport role: how one engine takes new weights, in three phases.

An engine holds exactly one transport, chosen from its configuration when it starts, and its ``WeightTarget``
calls map onto the phases:

- ``stage`` (``prepare``, generation still running): check the update against what the engine serves and move
  it as close to the engine as possible (files in shared memory, shadow parameters, a packed buffer...), so
  that the pause covers only the load. Raises ``WeightUpdateError`` with nothing applied.
- ``load`` (under the pause): make the staged weights live. All-or-nothing: on failure the engine serves its
  previous weights (``WeightUpdateError``) or is declared undefined (``EngineError``); never half of each.
- ``release`` (once per staged update, loaded or not): let go of what ``stage`` held.

A transport declares the update kinds it carries (``accepts``: every weight, or a LoRA adapter); the engine asks
it in ``prepare`` (``check_carries``) and refuses any other kind before anything is staged, naming both. The
transport then reads the update's source only through what every source offers (``updates.WeightSource``: its
tensors, the files already holding it and their headers), never by its type.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from asyncrl.engines.updates import UpdateKind, WeightUpdate, check_kind

__all__ = ["FULL_ONLY", "Transport", "WeightTransport", "check_carries"]

FULL_ONLY = frozenset({UpdateKind.FULL})


@runtime_checkable
class WeightTransport(Protocol):
    kind: str  # "files", "cuda_ipc", "sleep", "nccl", "lora": for logs, metrics and refusals

    @property
    def accepts(self) -> frozenset[UpdateKind]:
        """The update kinds this transport carries (a class attribute where it is fixed): ``stage`` is only
        ever given one of them."""
        ...

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


def check_carries(engine: str, transport: WeightTransport, update: WeightUpdate) -> None:
    """What an engine's ``prepare`` asks first: ``WeightUpdateError`` naming the transport's kind and the
    update's where ``transport`` does not carry ``update``'s kind."""
    check_kind(engine, f"{transport.kind!r} transport", transport.accepts, update)
