"""Driving multi-turn episodes through any ``Sampler`` (in-process vLLM, a remote server, a pool, the fake).

Each model turn is one ``generate(context, n=1)`` call on the whole context so far (prompt + every id of the
earlier turns and environment steps), so the engine sees exactly the ids that will be trained; a remote server
receives them as ids too. The ``n`` episodes of a group run concurrently; the first one that fails cancels the
others (their engine requests are aborted, their environments closed).

Pauses mid-episode follow the pause mode. ``keep``: the running turn freezes and continues under the new
weights, its spans split at the pause. ``wait``: the running turn finishes under the old weights; the next turn
waits for the resume. ``abort``: the cut turn's partial tokens are thrown away and the turn is sampled again
from the same context (the request waits in the paused engine, so it runs on the new weights), at most
``ProducerConfig.max_resubmits`` times; earlier turns keep their tokens and versions. With
``AbortPolicy.DROP`` a cut turn drops the group (``aborted``).

Failures become counted drops (``RolloutDropped``): an environment that raises (``env_error``), overruns
``env_timeout_s`` (``env_timeout``), appends more than ``max_env_tokens`` ids (``env_output_too_long``) or an id
outside the sampler's ``vocab_size`` (``out_of_vocabulary``, found before the context reaches the engine), a tool
that overruns (``tool_timeout``), a turn cut too often (``aborted``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from asyncrl.aio import bounded, together
from asyncrl.config import AbortPolicy, ProducerConfig
from asyncrl.engines.protocols import Sampler
from asyncrl.episodes.trajectory import TrajectoryBuilder
from asyncrl.episodes.types import Env, EnvFactory, Episode, StepResult
from asyncrl.errors import RolloutDropped
from asyncrl.types import DropReason, FinishReason, Prompt, Sample

log = logging.getLogger(__name__)

__all__ = ["EpisodeCounters", "EpisodeRunner", "episode_metrics"]


RECENT_EPISODES = 256  # episodes the ``episode/*`` means are taken over


@dataclass(slots=True)
class EpisodeCounters:
    """Totals over the episodes one runner finished (dropped episodes are counted as drops, not here), and the
    last ``RECENT_EPISODES`` of them for means: a window of the most recent episodes, not "since the last
    step", because short episodes finish first and a short interval would see mostly those."""

    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0  # wall time in environment calls, seconds
    truncated: int = 0  # episodes ended by a limit (turns or tokens), finish reason ``length``
    resubmitted: int = 0  # turns cut by an ``abort`` pause and sampled again
    # (turns, tool calls, tool errors, env seconds, truncated) of the most recent episodes
    recent: deque[tuple[int, int, int, float, bool]] = field(default_factory=lambda: deque(maxlen=RECENT_EPISODES))

    def add(self, episode: Episode) -> None:
        truncated = episode.trajectory.finish_reason is FinishReason.LENGTH
        self.episodes += 1
        self.turns += episode.turns
        self.tool_calls += episode.tool_calls
        self.tool_errors += episode.tool_errors
        self.env_s += episode.env_s
        self.truncated += truncated
        self.recent.append((episode.turns, episode.tool_calls, episode.tool_errors, episode.env_s, truncated))


def episode_metrics(counters: Sequence[EpisodeCounters]) -> dict[str, float]:
    """``episode/*`` gauges over one or more runners: totals, and means over their recent episodes."""
    recent = [r for c in counters for r in c.recent]
    per = 1 / len(recent) if recent else 0.0
    return {
        "episode/episodes": sum(c.episodes for c in counters),
        "episode/tool_calls": sum(c.tool_calls for c in counters),
        "episode/tool_errors": sum(c.tool_errors for c in counters),
        "episode/resubmitted_turns": sum(c.resubmitted for c in counters),
        "episode/turns_mean": sum(r[0] for r in recent) * per,
        "episode/tool_calls_mean": sum(r[1] for r in recent) * per,
        "episode/tool_call_rate": sum(r[1] > 0 for r in recent) * per,  # share of episodes calling a tool
        "episode/tool_errors_mean": sum(r[2] for r in recent) * per,
        "episode/env_s_mean": sum(r[3] for r in recent) * per,
        "episode/truncated_frac": sum(r[4] for r in recent) * per,
    }


@dataclass(slots=True)
class _Play:
    """One episode in progress."""

    trajectory: TrajectoryBuilder
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0


class EpisodeRunner:
    """Plays the episodes of a group: one environment per episode, one ``generate`` call per model turn."""

    def __init__(self, sampler: Sampler, env_factory: EnvFactory, config: ProducerConfig | None = None,
                 counters: EpisodeCounters | None = None) -> None:
        self.sampler = sampler
        self.env_factory = env_factory
        self.config = config or ProducerConfig()
        self.counters = counters if counters is not None else EpisodeCounters()

    async def run_group(self, group_id: str, prompt: Prompt) -> list[Episode]:
        """``SamplingConfig.n`` episodes from ``prompt``, concurrently. Raises ``RolloutDropped`` (the group is
        dropped) or ``PromptRejected`` (the engine refused a context)."""
        return await together(*(self.run(prompt, f"{group_id}/e{i}") for i in range(self.config.sampling.n)))

    async def run(self, prompt: Prompt, request_id: str) -> Episode:
        """One episode; its turns' request ids are ``{request_id}/t{turn}``."""
        play = _Play(TrajectoryBuilder())
        env = await self._timed(play, self._make_env(prompt), "creation")
        try:
            finish = await self._play(env, prompt, request_id, play)
        finally:
            t0 = time.perf_counter()
            await self._close(env, request_id)
            play.env_s += time.perf_counter() - t0
        episode = Episode(play.trajectory.build(finish), play.reward, play.turns, play.tool_calls,
                          play.tool_errors, play.env_s)
        self.counters.add(episode)
        return episode

    async def _play(self, env: Env, prompt: Prompt, request_id: str, play: _Play) -> FinishReason:
        """Turns until the environment is done or a limit is reached; returns how the episode ended."""
        cfg = self.config.episode
        budget = min(cfg.max_episode_tokens, self.sampler.max_model_len - len(prompt.token_ids))
        context = list(prompt.token_ids)
        for turn in range(cfg.max_turns):
            room = budget - len(play.trajectory)
            if room <= 0:
                return FinishReason.LENGTH
            sample = await self._sample_turn(tuple(context), room, f"{request_id}/t{turn}")
            play.trajectory.add_turn(sample)
            context.extend(sample.token_ids)
            play.turns += 1
            result = await self._step(env, sample, play)
            if len(result.token_ids) > budget - len(play.trajectory):
                # Never cut the environment's ids: a context it did not write. The episode ends here instead.
                return FinishReason.STOP if result.done else FinishReason.LENGTH
            play.trajectory.add_env(result.token_ids, result.text)
            context.extend(result.token_ids)
            if result.done:
                return FinishReason.STOP
        return FinishReason.LENGTH

    async def _sample_turn(self, context: tuple[int, ...], room: int, request_id: str) -> Sample:
        """One model turn; a turn cut by an ``abort`` pause is sampled again from the same context."""
        sampling = self.config.sampling
        params = replace(sampling, n=1, max_tokens=min(sampling.max_tokens, room))
        resubmits = 0
        while True:
            rid = request_id if not resubmits else f"{request_id}/r{resubmits}"
            [sample] = await self.sampler.generate(context, params, request_id=rid, n=1)
            if sample.finish_reason is not FinishReason.ABORT:
                return sample
            if self.config.on_abort is AbortPolicy.DROP or resubmits >= self.config.max_resubmits:
                raise RolloutDropped(DropReason.ABORTED, f"turn {request_id} cut by an abort pause "
                                                         f"({resubmits} resubmits, max_resubmits "
                                                         f"{self.config.max_resubmits}, on_abort "
                                                         f"{self.config.on_abort.value})")
            resubmits += 1
            self.counters.resubmitted += 1

    async def _step(self, env: Env, turn: Sample, play: _Play) -> StepResult:
        result = await self._timed(play, env.step(turn), "step")
        if not isinstance(result, StepResult):
            raise RolloutDropped(DropReason.ENV_ERROR, f"environment step returned {type(result).__name__}, "
                                                       f"not a StepResult")
        limit = self.config.episode.max_env_tokens
        if len(result.token_ids) > limit:
            raise RolloutDropped(DropReason.ENV_OUTPUT_TOO_LONG, f"environment step returned "
                                                                 f"{len(result.token_ids)} ids; max_env_tokens is "
                                                                 f"{limit}")
        vocab = self.sampler.vocab_size
        if (bad := next((t for t in result.token_ids if not 0 <= t < vocab), None)) is not None:
            raise RolloutDropped(DropReason.OUT_OF_VOCABULARY, f"environment step returned token id {bad}, outside "
                                                               f"the vocabulary of {self.sampler.name} (ids 0 to "
                                                               f"{vocab - 1})")
        play.reward += result.reward
        play.tool_calls += result.tool_calls
        play.tool_errors += result.tool_errors
        return result

    async def _make_env(self, prompt: Prompt) -> Env:
        made = self.env_factory(prompt)
        return await made if inspect.isawaitable(made) else made

    async def _timed(self, play: _Play, aw: Any, what: str) -> Any:
        """An environment call, bounded by ``env_timeout_s``; its failures become counted drops."""
        limit = self.config.episode.env_timeout_s
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(limit) as scope:
                return await aw
        except TimeoutError as exc:
            if scope.expired():
                raise RolloutDropped(DropReason.ENV_TIMEOUT, f"environment {what} took longer than "
                                                             f"env_timeout_s={limit}s") from None
            raise RolloutDropped(DropReason.ENV_ERROR, f"environment {what} raised {exc!r}") from exc
        except RolloutDropped:
            raise  # the environment (or a tool) chose the reason itself
        except Exception as exc:  # cancellation is a BaseException: it passes through untouched
            raise RolloutDropped(DropReason.ENV_ERROR, f"environment {what} raised {exc!r}") from exc
        finally:
            play.env_s += time.perf_counter() - t0

    async def _close(self, env: Env, request_id: str) -> None:
        # Bounded and run to its end even while the episode is being cancelled (a sibling failed): the
        # environment's resources are released either way. Its failure does not spoil a finished episode.
        try:
            await bounded(env.close(), self.config.episode.env_timeout_s, f"closing the environment of {request_id}")
        except Exception as exc:
            log.warning("closing the environment of %s failed: %r", request_id, exc)
