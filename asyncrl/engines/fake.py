"""An in-memory engine for fast unit tests and the queue micro-benchmark.

It plays all three engine roles and follows their pause semantics: ``abort`` cuts in-flight samples, ``keep``
freezes them until resume, ``wait`` returns once they finish. Tokens are produced one per ``token_delay_s`` (0 = all at
once), each with log-prob ``logprob``; token ``t`` of sample ``i`` is ``(sum(prompt) + i + t) % vocab_size``, so a
multi-turn context changes what comes next. A token in ``stop_token_ids`` ends the sample (``stop``). A prompt id
outside ``[0, vocab_size)`` is refused, as a real engine refuses it. ``length_fn(prompt_ids, index)``, if given, is
sample ``index``'s completion length (it stops there, capped by ``max_tokens``): random or heavy-tailed lengths for
scheduling tests.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping

from asyncrl.config import SamplingConfig
from asyncrl.engines.death import Death
from asyncrl.engines.protocols import (BehaviourPrecision, Engine, EngineError, PromptRejected, WeightUpdate,
                                       WeightUpdateError)
from asyncrl.types import FinishReason, PauseMode, Sample, VersionSpan


class FakeEngine(Engine):
    def __init__(self, *, token_delay_s: float = 0.0, max_model_len: int = 256, logprob: float = -1.0,
                 vocab_size: int = 100, name: str = "fake",
                 length_fn: Callable[[tuple[int, ...], int], int] | None = None,
                 precision: BehaviourPrecision | None = None) -> None:
        self.name = name
        self._precision = precision
        self.length_fn = length_fn
        self._version = 0
        self._max_model_len = max_model_len
        self.token_delay_s = token_delay_s
        self.logprob = logprob
        self._vocab_size = vocab_size
        self._running = asyncio.Event()  # set while not paused
        self._running.set()
        self._abort_epoch = 0  # bumped by every abort pause; samples started before it are cut
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.weights: Mapping[str, object] = {}
        self._death = Death()
        self.closed = False
        self.requests = 0  # generate calls served
        self.token_produced = asyncio.Event()  # set once any token has been sampled (tests wait on it)

    @property
    def version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        """Set to False to kill the engine: every call fails from then on, and ``wait_dead`` returns."""
        return not self._death.declared

    @alive.setter
    def alive(self, alive: bool) -> None:
        if alive and self._death.declared:
            raise ValueError("a dead fake engine stays dead")
        if not alive:
            self._death.declare(EngineError(self.name, "fake engine marked dead"))

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def behaviour_precision(self) -> BehaviourPrecision | None:
        return self._precision

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        if not prompt_ids:
            raise PromptRejected("empty prompt")
        if len(prompt_ids) >= self._max_model_len:
            raise PromptRejected(f"prompt of {len(prompt_ids)} tokens exceeds context {self._max_model_len}")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise PromptRejected(f"prompt holds a token id outside the vocabulary of {self.vocab_size}", too_long=False)
        self.requests += 1
        count = params.n if n is None else n
        if self.token_delay_s:
            return list(await asyncio.gather(*(self._one(prompt_ids, params, i) for i in range(count))))
        samples = []  # no delay: one after the other (a plain loop; an async comprehension costs a frame)
        for i in range(count):
            samples.append(await self._one(prompt_ids, params, i))
        return samples

    async def _one(self, prompt_ids: tuple[int, ...], params: SamplingConfig, index: int) -> Sample:
        if not self._running.is_set():
            await self._running.wait()
        self._enter()
        try:
            return await self._decode(prompt_ids, params, index)
        finally:
            self._leave()

    async def _decode(self, prompt_ids: tuple[int, ...], params: SamplingConfig, index: int) -> Sample:
        epoch = self._abort_epoch
        first = sum(prompt_ids) + index  # token t is (first + t) % vocab_size
        tokens: list[int] = []
        # (version, index of its first token) each time the version changes; the spans are built once at
        # the end rather than a new VersionSpan per token
        starts: list[tuple[int, int]] = []
        stop = params.stop_token_ids
        limit = params.max_tokens if self.length_fn is None else min(params.max_tokens,
                                                                       self.length_fn(prompt_ids, index))
        for t in range(limit):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self._abort_epoch != epoch:
                return self._sample(tokens, starts, FinishReason.ABORT)
            if not self._running.is_set():
                self._leave()  # keep: frozen requests do not hold a ``wait`` pause
                await self._running.wait()
                self._enter()
            self._check_alive()
            if not starts or starts[-1][0] != self._version:
                starts.append((self._version, t))
            tokens.append((first + t) % self.vocab_size)
            self.token_produced.set()
            if stop and tokens[-1] in stop:
                return self._sample(tokens, starts, FinishReason.STOP)
        return self._sample(tokens, starts, FinishReason.LENGTH if limit == params.max_tokens else FinishReason.STOP)

    def _sample(self, tokens: list[int], starts: list[tuple[int, int]], reason: FinishReason) -> Sample:
        ids = tuple(tokens)
        spans = _spans(starts, len(ids)) if starts else (VersionSpan(self._version, 0, 0),)
        return Sample(ids, (self.logprob,) * len(ids), reason, spans, text=_text(ids))

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._check_alive()
        self._running.clear()
        if PauseMode(mode) is PauseMode.ABORT:
            self._abort_epoch += 1
        elif PauseMode(mode) is PauseMode.WAIT:
            self._running.set()  # let in-flight samples run to the end, then hold new ones
            await self._idle.wait()
            self._running.clear()

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        if any(not hasattr(t, "shape") for t in update.tensors.values()):
            raise WeightUpdateError("fake engine: every value must be a tensor")
        return update

    async def load(self, update: WeightUpdate) -> None:
        self._check_alive()
        self.weights = dict(update.tensors)
        self._version = update.version

    def release(self, update: WeightUpdate) -> None:
        pass

    async def resume(self) -> None:
        self._running.set()

    def _check_alive(self) -> None:
        if self._death.error is not None:
            raise self._death.error

    async def check_alive(self) -> None:
        self._check_alive()

    async def wait_dead(self) -> EngineError:
        return await self._death.wait()

    async def close(self) -> None:
        self.closed = True
        self._running.set()


def _spans(starts: list[tuple[int, int]], end: int) -> tuple[VersionSpan, ...]:
    """Version spans from the (version, first token) pairs of a completion of ``end`` tokens."""
    if len(starts) == 1:  # the common case: one version throughout
        return (VersionSpan(starts[0][0], starts[0][1], end),)
    ends = [start for _, start in starts[1:]] + [end]
    return tuple(VersionSpan(version, start, stop) for (version, start), stop in zip(starts, ends))


@functools.lru_cache(maxsize=4096)
def _text(tokens: tuple[int, ...]) -> str:
    # The fake detokeniser; cached because completions repeat (tokens depend only on prompt and index).
    return " ".join(map(str, tokens))
