"""The narrow roles the rest of asyncrl talks to, one Protocol each.

- ``Sampler`` (producers): generate completions, tagged with the weight version that produced each token.
- ``WeightTarget`` (the learner's ``WeightSync``): prepare an update, pause, load, resume (an engine does it
  through its one ``transports.WeightTransport``); and, optionally, sleep while a colocated learner trains (the
  defaults never sleep) and score a sequence for the publication probe (the default cannot).
- ``Lifecycle`` (the pipeline): is it alive, wait for its death, close it.
- ``BaseLender`` (a LoRA learner beside the engine): the served weights, for the learner's frozen base.

Optional behaviour is a documented no-op default on the role, never probed: an implementation subclasses the
role (``class FakeEngine(Engine)``) to inherit the defaults, and callers just call.

An engine plays whichever roles it can: ``VLLMEngine`` (vLLM in this process), ``RemoteVLLMEngine`` (a vLLM
server over HTTP), ``EnginePool`` and ``SupervisedEngine`` play all three; ``RemoteControlEngine`` (an engine
embedded in another service) is a weight target with a lifecycle and never samples. Nothing outside
``asyncrl.engines`` imports vLLM.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from asyncrl.config import SamplingConfig
from asyncrl.engines.updates import StagedInEngine, WeightUpdate
from asyncrl.errors import ConfigError, EngineError, PromptRejected, WeightUpdateError
from asyncrl.lora.shared_base import LentBase
from asyncrl.types import PauseMode, Sample

__all__ = ["BaseLender", "BehaviourPrecision", "Engine", "EngineError", "LentBase", "Lifecycle", "PromptRejected",
           "Sampler", "StagedInEngine", "WeightTarget", "WeightUpdate", "WeightUpdateError", "request_seed"]


@dataclass(frozen=True, slots=True)
class BehaviourPrecision:
    """The numerics an engine samples in, and so the ones its behaviour log-probs carry. A declared quantization
    (of the weights or the KV cache) makes sampling differ from the learner's numerics on purpose: the importance
    weights then correct the gap, as they correct staleness (``recipes.check_engine_fits`` reports the pairing)."""

    dtype: str  # the weights' compute dtype as the engine resolved it ("bfloat16", "float32"...)
    quantization: str | None = None  # the weights' quantization method (vLLM's name: "fp8"...); None: none
    kv_cache_dtype: str | None = None  # the KV cache's dtype where it is not ``dtype`` ("fp8"...); None: ``dtype``

    @property
    def quantized(self) -> bool:
        """Whether the engine declares numerics coarser than its dtype (weights or KV cache quantized)."""
        return self.quantization is not None or self.kv_cache_dtype is not None

    def describe(self) -> str:
        """E.g. ``"bfloat16"``, ``"bfloat16, fp8 weights, fp8 KV cache"``."""
        parts = [self.dtype]
        if self.quantization is not None:
            parts.append(f"{self.quantization} weights")
        if self.kv_cache_dtype is not None:
            parts.append(f"{self.kv_cache_dtype} KV cache")
        return ", ".join(parts)


def request_seed(seed: int | None, request_id: str) -> int | None:
    """A per-request sampling seed: reproducible for a run seed, different for every request (a seed per
    sample index alone would give every group the same random stream)."""
    return None if seed is None else (seed * 1_000_003 + zlib.crc32(request_id.encode())) % 2**31


@runtime_checkable
class Sampler(Protocol):
    """What a producer needs: completions with behaviour log-probs and version spans."""

    name: str  # for logs and errors

    @property
    def version(self) -> int:
        """The weight version new tokens are sampled with."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt + completion tokens accepted. Producers drop prompts that leave no room."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids accepted in a prompt: ``0 <= id < vocab_size`` (what the engine validates; a model may pad
        it above its tokenizer's vocabulary). Producers drop prompts, and episode runners environment steps,
        holding an id outside it (``DropReason.OUT_OF_VOCABULARY``) before any engine call; ``generate``
        refuses such a prompt with ``PromptRejected``."""
        ...

    @property
    def behaviour_precision(self) -> BehaviourPrecision | None:
        """The precision the engine samples in, as the engine resolved it, or None where it cannot be known (a
        server started elsewhere: vLLM does not report it; the default). ``grpo_pipeline`` refuses an engine whose
        plain dtype differs from the learner's by accident (the importance ratios would measure that gap, not
        staleness), and accepts and reports one that declares a quantization."""
        return None

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        """Sample ``n`` (default ``params.n``) completions. Called by producers, many at once; in an episode,
        once per model turn with ``n=1`` on the whole context so far (``asyncrl.episodes.EpisodeRunner``).

        Each sample carries per-token behaviour log-probs and version spans. Samples cut by an ``abort``
        pause come back with ``FinishReason.ABORT`` and the tokens produced so far. Cancelling the call
        aborts its requests in the engine. A refused prompt (empty, too long, an id outside ``vocab_size``, or
        anything else the engine validates) raises ``PromptRejected``.
        """
        ...

    def for_session(self, key: str) -> Sampler:
        """The sampler that serves session ``key``'s calls (an agent episode's, through
        ``asyncrl.agents.AgentEndpoint``), so that they can share an engine's prefix cache. Default: this one
        (a single engine); ``EnginePool`` pins each session to one member."""
        return self

    def end_session(self, key: str) -> None:
        """Session ``key`` makes no more calls: forget where it was pinned. Default: nothing to forget."""


@runtime_checkable
class WeightTarget(Protocol):
    """What the learner's ``WeightSync`` drives, always in this order: ``prepare`` (generation still running),
    ``pause``, ``load``, ``resume`` (always, even after a failure or a cancellation), ``release``."""

    name: str

    @property
    def version(self) -> int:
        """The weight version the target serves."""
        ...

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        """Validate and stage ``update`` while generation still runs, so the pause covers only the load (an
        engine does it through its one ``WeightTransport``). Raises ``WeightUpdateError`` with nothing applied,
        naming a source the target cannot take. Returns the update with ``staged`` set."""
        ...

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """Stop sampling before ``load``. A cancelled pause is followed by ``resume``."""
        ...

    async def load(self, update: WeightUpdate) -> None:
        """Load a prepared update while paused, then report ``update.version`` for every new token.

        All-or-nothing: on failure the target keeps its previous weights and version and this raises
        ``WeightUpdateError``. ``WeightSync`` never cancels a load half-way."""
        ...

    async def resume(self) -> None:
        """Continue sampling after ``pause``. Safe to call when not paused."""
        ...

    def release(self, update: WeightUpdate) -> None:
        """Free what ``prepare`` held for ``update``; called once per prepared update, loaded or not (a target
        that loaded it keeps its own reference to the staged weights)."""
        ...

    async def score(self, token_ids: Sequence[int]) -> Mapping[str, list[float]]:
        """Each engine's log-prob of every token after the first given those before it, at temperature 1, under
        the weights it serves now, by engine name (one entry; a pool's every live member): what the learner's
        publication probe (``SyncConfig.probe_tolerance``) compares with its own. Default: this target cannot be
        scored, and a probe asked of it fails the run saying so."""
        raise ConfigError("SyncConfig.probe_tolerance", f"{self.name} cannot score sequences, so its publications "
                                                        "cannot be probed: leave it unset")

    # Sleeping: freeing accelerator memory while a learner sharing the device trains (``VLLMEngine`` with
    # ``VLLMEngineConfig.sleep``; ``EnginePool`` and ``SupervisedEngine`` forward it). The synchronous pipeline
    # drives it: ``sleep`` after a batch is generated; the publication that follows wakes it (``load`` wakes the
    # weights, ``resume`` the rest); ``wake`` after a step that published nothing. The defaults never sleep.

    @property
    def sleep_level(self) -> int:
        """1 (a host copy of the weights is kept) or 2 (nothing kept: only an update wakes it); 0 (the
        default): never sleeps, and the pipeline does not call ``sleep``."""
        return 0

    async def sleep(self, level: int | None = None) -> None:
        """Pause and free memory at ``level`` (default ``sleep_level``). Default: nothing to free."""

    async def wake(self) -> None:
        """Wake without an update, with the weights it slept with. No-op when awake (always, by default)."""


@runtime_checkable
class Lifecycle(Protocol):
    """What the pipeline needs to watch and stop an engine."""

    name: str

    async def check_alive(self) -> None:
        """Raise ``EngineError`` if the engine (or its process) is gone, as far as is known now."""
        ...

    async def wait_dead(self) -> EngineError:
        """Return (not raise), once the engine has died or been closed, the ``EngineError`` saying so. The
        pipeline awaits it for the whole run: it must wait on the engine's own signal (see ``engines.death``),
        not poll. Default: the engine gives no such signal, and this never returns."""
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Shut down and release processes and staged files. Idempotent."""
        ...


class BaseLender(Protocol):
    """An engine that lends its served weights to a LoRA learner on the same device (``VLLMEngine`` on CUDA,
    serving adapters), so that the frozen base is held once."""

    name: str

    async def lend_base(self) -> LentBase:
        """The weights this engine serves, mapped into this process. ``ConfigError`` names what keeps them from
        being lent (a CPU engine, a full-weight engine, quantization, more than one worker)."""
        ...


@runtime_checkable
class Engine(Sampler, WeightTarget, Lifecycle, Protocol):
    """An engine in all three roles, as the single-engine pipeline wiring expects."""
