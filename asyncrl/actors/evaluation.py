"""Held-out evaluation during training: a learner hook that makes groups of fixed prompts on the engine every
``every`` steps, with any group maker, and adds ``eval/*`` gauges to that step's metrics (so every sink gets
them)::

    evaluator = Evaluator(engine, held_out, RewardGroups(reward_fn), every=50, config=pipeline_config.producer)
    pipeline.learner.hooks.append(evaluator)
    before = await evaluator.evaluate()  # also callable by hand: before and after training

An evaluation is a ``Producer`` with no queue behind it, driving a fork of the maker (``GroupMaker.fork``: the
same functions, books of its own): the same reward machinery (a synchronous reward runs in worker threads, every
call bounded by ``reward_timeout_s``), the same episodes, judges or agents as training, samples cut by an
``abort`` pause sampled again. Its requests run beside the producers' (nothing is paused), with request ids
prefixed ``asyncrl-eval-<evaluator>-<round>-``, which no producer uses.

Sampling is greedy by default: ``GREEDY_TEMPERATURE``, below vLLM's threshold for argmax decoding
(``SamplingConfig`` refuses 0), with the training config's length limit and stop ids; pass ``sampling`` for
another temperature or several samples per prompt.

When it runs: learner hooks run after the step's publication has landed (``SyncConfig(overlap=False)``, the
default), so it measures the served weights; on a step that did not publish (``every`` not a multiple of
``sync.every``) those are the last published ones; ``eval/version`` says which. With ``overlap=True`` the
step's publication may still be in flight: evaluation requests wait in the paused engine as the producers' do
(``keep``, ``wait``) or are cut and sampled again (``abort``), so nothing deadlocks, but one evaluation may
span two versions.

A reward that raises, times out or returns a non-number, or a prompt the engine refuses, stops the run with
``InvalidGroupError`` naming the prompt and the step: a quietly lower accuracy would mislead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Iterable

from asyncrl.actors.producer import Producer
from asyncrl.aio import first_cause
from asyncrl.config import InvalidGroupPolicy, ProducerConfig, SamplingConfig
from asyncrl.data import PromptSource
from asyncrl.engines.protocols import Sampler
from asyncrl.errors import InvalidGroupError
from asyncrl.groups.maker import GroupMaker
from asyncrl.types import Prompt, RolloutGroup, Sample

__all__ = ["GREEDY_TEMPERATURE", "Evaluator", "greedy"]

GREEDY_TEMPERATURE = 1e-6  # vLLM decodes greedily below 1e-5; SamplingConfig requires a temperature > 0
REQUEST_PREFIX = "asyncrl-eval-"


def greedy(sampling: SamplingConfig | None = None) -> SamplingConfig:
    """One greedy completion per prompt, with ``sampling``'s length limit and stop ids."""
    s = sampling or SamplingConfig()
    return SamplingConfig(n=1, max_tokens=s.max_tokens, temperature=GREEDY_TEMPERATURE,
                          stop_token_ids=s.stop_token_ids)


class Evaluator:
    """A learner hook (``learner.hooks.append(evaluator)``) evaluating ``prompts`` every ``every`` steps (0: only
    when ``evaluate`` is called).

    ``groups``: the maker, the training pipeline's own or another (``RewardGroups``, ``EpisodeGroups``,
    ``JudgedGroups``, an ``AgentRunner``, one of your own). ``config`` supplies the reward limits
    (``reward_timeout_s``, ``sync_rewards``, ``reward_threads``), the episode limits and, unless ``sampling`` is
    given, the length limit and stop ids of the greedy sampling; pass the pipeline's ``config.producer``.
    ``concurrency``: prompts in flight.

    Metrics: ``eval/accuracy`` and ``eval/reward_mean`` (the mean reward over all samples: the accuracy for a 0/1
    reward, a win probability for a judge), ``eval/samples``, ``eval/dropped`` (groups cut by abort pauses too
    often, or ties), ``eval/version`` (the version served when it started), ``eval/s``; and the round's own
    gauges of the maker (``eval/episode/*``, ``eval/judge/*``, ``eval/agent/*``).
    """

    def __init__(self, engine: Sampler, prompts: Iterable[Prompt], groups: GroupMaker, *, every: int,
                 sampling: SamplingConfig | None = None, config: ProducerConfig | None = None,
                 concurrency: int = 256) -> None:
        if every < 0 or concurrency < 1:
            raise ValueError(f"Evaluator needs every >= 0 and concurrency >= 1, got {every} and {concurrency}")
        if not isinstance(groups, GroupMaker):
            raise TypeError(f"an Evaluator needs a GroupMaker (e.g. asyncrl.RewardGroups(reward_fn)), got "
                            f"{type(groups).__name__}")
        self.engine, self.maker, self.every = engine, groups, every
        self.prompts = list(prompts)
        if not self.prompts:
            raise ValueError("an Evaluator needs at least one prompt")
        base = config or ProducerConfig()
        # FAIL: a broken reward or prompt stops the run instead of lowering the accuracy.
        self.config = dataclasses.replace(base, sampling=sampling or greedy(base.sampling),
                                          on_invalid=InvalidGroupPolicy.FAIL,
                                          max_inflight_groups=min(concurrency, len(self.prompts)))
        self.rounds = 0  # evaluations started
        self.seconds = 0.0  # total time spent evaluating
        self.groups: list[RolloutGroup] = []  # the last evaluation's scored groups, in finish order
        self._lock = asyncio.Lock()  # one evaluation at a time (the groups, the totals)

    async def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if self.every and step % self.every == 0:
            try:
                metrics.update(await self.evaluate())
            except InvalidGroupError as exc:
                raise InvalidGroupError(f"evaluation after step {step}: {exc}") from exc

    async def evaluate(self) -> dict[str, float]:
        """Sample and score every prompt now, on the weights the engine serves; the ``eval/*`` metrics."""
        async with self._lock:
            self.rounds += 1
            # This evaluator's identity and round: two evaluators (or rounds) never share a request id.
            sink, number, maker = _Collector(), f"{id(self):x}-{self.rounds}", self.maker.fork()
            producer = Producer(_Tagged(self.engine, f"{REQUEST_PREFIX}{number}-"), PromptSource(self.prompts),
                                maker, sink, self.config, name=f"evaluation {number}")
            version = self.engine.version
            t0 = time.perf_counter()
            try:
                await producer.run()
            except BaseExceptionGroup as group:  # the producer's task group: raise the error itself
                raise first_cause(group) from group
            finally:
                self.seconds += time.perf_counter() - t0
            self.groups = sink.groups
            rewards = [r.reward for g in sink.groups for r in g.rollouts]
            mean = math.fsum(rewards) / len(rewards) if rewards else math.nan
            out = {"eval/accuracy": mean, "eval/reward_mean": mean, "eval/samples": len(rewards),
                   "eval/dropped": sum(producer.counters.dropped.values()), "eval/version": version,
                   "eval/s": time.perf_counter() - t0}
            out.update({f"eval/{k}": v for k, v in maker.metrics().items()})
            return out


class _Collector:
    """The evaluation producer's sink: keeps the scored groups."""

    def __init__(self) -> None:
        self.groups: list[RolloutGroup] = []

    async def send(self, group: RolloutGroup, *, ticket: int | None = None) -> bool:
        self.groups.append(group)
        return True

    async def aclose(self) -> None:
        pass


class _Tagged(Sampler):
    """The engine as a ``Sampler`` whose request ids carry the evaluation's prefix (vLLM refuses an id already
    in flight, and the producers' ids are the prompts' own)."""

    def __init__(self, engine: Sampler, prefix: str) -> None:
        self.engine, self.prefix, self.name = engine, prefix, engine.name

    version = property(lambda self: self.engine.version)
    max_model_len = property(lambda self: self.engine.max_model_len)
    vocab_size = property(lambda self: self.engine.vocab_size)

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        return await self.engine.generate(prompt_ids, params, self.prefix + request_id, n)
