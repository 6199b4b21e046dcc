"""The group-maker role: how a prompt becomes a scored group, or a counted drop.

A producer owns admission, the sink, the books and the drop policy; everything between "here is a prompt" and
"here is a scored group" is its maker's. One maker per way::

    RewardGroups(reward_fn)               n completions, scored one by one        (asyncrl.groups)
    EpisodeGroups(env, reward_fn=None)    n multi-turn episodes of an environment (asyncrl.episodes)
    JudgedGroups(judge, opponent=None)    n completions judged in pairs           (asyncrl.preference)
    AgentRunner(endpoint, agent, ...)     n black-box agent sessions              (asyncrl.agents)

A trainer is a maker plus a loss: ``grpo_pipeline``, ``preference_pipeline``, ``resume_pipeline``, the
distributed runner and the ``Evaluator`` all take the one maker. Writing a new one means subclassing
``GroupMaker`` and implementing ``make``; ``sample_completions`` and ``check_prompt`` are the pieces the library's
own makers share.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from asyncrl.config import AbortPolicy, ProducerConfig
from asyncrl.engines.protocols import PromptRejected, Sampler
from asyncrl.errors import RolloutDropped
from asyncrl.types import DropReason, FinishReason, Prompt, RolloutGroup, Sample

__all__ = ["GroupMaker", "GroupRequest", "SamplingBooks", "check_prompt", "sample_completions"]


@dataclass(slots=True)
class SamplingBooks:
    """What sampling did on behalf of whoever asked (a producer's books, an evaluation round's)."""

    resubmitted: int = 0  # samples cut by an ``abort`` pause and sampled again


@dataclass(slots=True)
class GroupRequest:
    """One group to make: which prompt, where to sample, under which limits. Read-only by contract; not frozen,
    because a frozen dataclass costs 0.5 us more per group on the producer's hot path (bench.cpu.queue_micro)."""

    group_id: str  # unique and stable; request ids sent to the sampler start with it
    prompt: Prompt
    sampler: Sampler  # the producer's engine (an evaluation's: the same engine with tagged request ids)
    # sampling (n, temperature...), abort policy and resubmits, reward and episode limits
    config: ProducerConfig
    books: SamplingBooks = field(default_factory=SamplingBooks)  # charged with resubmits


@runtime_checkable
class GroupMaker(Protocol):
    """Turns a prompt into a scored ``RolloutGroup``. Shared by every producer of a pipeline (and its evaluator),
    so ``make`` runs for many groups at once; its books are its own."""

    async def make(self, request: GroupRequest) -> RolloutGroup:
        """The scored group for ``request.prompt``. Raises ``RolloutDropped`` to drop it under a reason (the
        producer counts it and applies its drop policy), ``NoProgressError`` when nothing trainable can come.
        Cancelling it aborts its engine requests and propagates ``CancelledError``."""
        ...

    def metrics(self) -> dict[str, float]:
        """This maker's gauges (``reward/*``, ``episode/*``, ``judge/*``, ``agent/*``), added to every learner
        step once per pipeline. Default: none."""
        return {}

    def fork(self) -> GroupMaker:
        """A maker with the same functions and fresh books: an evaluation round reports its own gauges without
        mixing them into training's. Default: a shallow copy, right for a maker without books."""
        return copy.copy(self)


def check_prompt(request: GroupRequest) -> None:
    """Drop a prompt the engine could not take (empty, leaving no room, an id outside the vocabulary) before any
    engine call."""
    prompt, sampler = request.prompt, request.sampler
    if not prompt.token_ids:
        raise RolloutDropped(DropReason.EMPTY_PROMPT, f"prompt {prompt.prompt_id!r} has no tokens")
    if len(prompt.token_ids) >= sampler.max_model_len:
        raise RolloutDropped(DropReason.PROMPT_TOO_LONG, f"prompt {prompt.prompt_id!r} has {len(prompt.token_ids)} "
                                                         f"tokens; the engine's context is {sampler.max_model_len}")
    vocab = sampler.vocab_size
    if min(prompt.token_ids) < 0 or max(prompt.token_ids) >= vocab:
        raise RolloutDropped(DropReason.OUT_OF_VOCABULARY, f"prompt {prompt.prompt_id!r} holds a token id outside "
                                                           f"the vocabulary of {sampler.name} (ids 0 to {vocab - 1})")


async def sample_completions(request: GroupRequest, sampler: Sampler | None = None) -> list[Sample]:
    """``SamplingConfig.n`` completions of the prompt (from ``sampler``, default the request's). Samples cut by an
    ``abort`` pause are sampled again, at most ``max_resubmits`` times (they wait in the paused engine, so they
    come from the new weights), or drop the group under ``AbortPolicy.DROP``."""
    sampler = sampler or request.sampler
    config, prompt = request.config, request.prompt
    try:
        samples = await sampler.generate(prompt.token_ids, config.sampling, request_id=request.group_id)
        for attempt in range(1, config.max_resubmits + 2):
            cut = [i for i, s in enumerate(samples) if s.finish_reason is FinishReason.ABORT]
            if not cut:
                return samples
            if config.on_abort is AbortPolicy.DROP or attempt > config.max_resubmits:
                raise RolloutDropped(DropReason.ABORTED, f"{len(cut)} of {len(samples)} samples cut by an abort "
                                                         "pause")
            request.books.resubmitted += len(cut)
            again = await sampler.generate(prompt.token_ids, config.sampling,
                                           request_id=f"{request.group_id}/r{attempt}", n=len(cut))
            for i, s in zip(cut, again):
                samples[i] = s
    except PromptRejected as exc:
        raise RolloutDropped(DropReason.PROMPT_TOO_LONG if exc.too_long else DropReason.ENGINE_ERROR,
                             str(exc)) from exc
    raise AssertionError("unreachable")
