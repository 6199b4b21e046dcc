"""All three engine roles over several engines: requests spread over the live ones, publications reach all.

Generation goes to the least-loaded member (samples in flight), ties broken round-robin. ``prepare`` stages an
update once, on the first member, and hands the staged copy to the others (members serving the same model on
one host share one staging directory); ``pause``, ``load`` and ``resume`` then run on every live member
concurrently. Each member's load is all-or-nothing on its own, and a failure names the members it happened on.
A member that stops answering (``check_alive`` fails, or a generate fails and the member then fails
``check_alive``) is reported with an ``EngineError`` naming it, or, with ``drop_dead=True``, taken out of
rotation for good with a warning and counted in ``metrics()``.

Sessions (``for_session``: an agent episode's calls through ``asyncrl.agents.AgentEndpoint``) are sticky: each is
pinned to the member its first call went to, so the context its calls share stays in that member's prefix cache.
A session whose member leaves rotation moves to another, and the move is counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import Field

from asyncrl.aio import TaskOwner, settle
from asyncrl.config import SamplingConfig
from asyncrl.config_base import Flag, config
from asyncrl.engines.protocols import BehaviourPrecision, Engine, EngineError, Sampler, WeightUpdate, WeightUpdateError
from asyncrl.types import PauseMode, Sample

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Member:
    engine: Engine
    load: int = 0  # samples in flight on this member
    alive: bool = True  # False once taken out of rotation


@config
class PoolConfig:
    """How an ``EnginePool`` treats its members."""

    drop_dead: Annotated[Flag, Field(description=(
        "take a dead member out of rotation (its samples are drawn again elsewhere) instead of failing the "
        "call with an ``EngineError`` naming it"))] = False


class EnginePool(Engine):
    """``Engine`` over N engines (e.g. ``RemoteVLLMEngine``s, one per server). Owns them: ``close`` closes all.
    The per-member tasks of ``prepare`` and ``wait_dead`` belong to a ``TaskOwner`` scoped to the call: none
    outlives it."""

    def __init__(self, engines: Sequence[Engine], config: PoolConfig | None = None, *, name: str = "pool") -> None:
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"EnginePool members need distinct names, got {names}")
        self.name = name
        self._members = [_Member(e) for e in engines]
        self.config = config or PoolConfig()
        self._drop_dead = self.config.drop_dead
        self._turn = 0  # round-robin offset among equally loaded members
        self._sessions: dict[str, _Member] = {}  # the member each open session is pinned to
        self.session_moves = 0  # sessions moved off a member that left rotation
        # Each member's own prepared form of an update, by version (released in ``release``).
        self._prepared: dict[int, list[tuple[_Member, WeightUpdate]]] = {}

    @property
    def version(self) -> int:
        """The oldest version among live members (they differ only after a partly failed update)."""
        return min(m.engine.version for m in self._live_or_all())

    @property
    def max_model_len(self) -> int:
        return min(m.engine.max_model_len for m in self._members)

    @property
    def behaviour_precision(self) -> BehaviourPrecision | None:
        """The members' precision when they all know and agree on it, else None (unknown)."""
        found = {m.engine.behaviour_precision for m in self._members}
        return found.pop() if len(found) == 1 else None

    @property
    def vocab_size(self) -> int:
        return min(m.engine.vocab_size for m in self._members)

    @property
    def live(self) -> tuple[str, ...]:
        """Names of the members in rotation."""
        return tuple(m.engine.name for m in self._members if m.alive)

    def metrics(self) -> dict[str, float]:
        return {"engine/alive": sum(m.alive for m in self._members),
                "engine/dead": sum(not m.alive for m in self._members),
                "engine/inflight_samples": sum(m.load for m in self._members),
                "engine/sessions": len(self._sessions), "engine/session_moves": self.session_moves}

    # -- generation ------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None, *, session: str | None = None) -> list[Sample]:
        """Least-loaded member; with ``session`` (through ``for_session``) the member that session is pinned to."""
        count = params.n if n is None else n
        while True:
            member = self._pick() if session is None else self._pinned(session)
            member.load += count
            try:
                return await member.engine.generate(prompt_ids, params, request_id, n)
            except EngineError as exc:
                if not await self._dropped_after(member, exc):
                    raise
                # The member is out of rotation: its samples are lost; sample them again on another member.
            finally:
                member.load -= count

    def for_session(self, key: str) -> Sampler:
        """Calls of session ``key`` go to one member while it lives (its prefix cache holds their shared
        context); when it dies (``drop_dead``) the session moves to another, counted as ``session_moves``."""
        return _SessionSampler(self, key)

    def end_session(self, key: str) -> None:
        self._sessions.pop(key, None)

    def _pinned(self, key: str) -> _Member:
        member = self._sessions.get(key)
        if member is not None and member.alive:
            return member
        if member is not None:
            self.session_moves += 1
            log.info("session %s moves off %s, which left rotation", key, member.engine.name)
        self._sessions[key] = member = self._pick()
        return member

    def _pick(self) -> _Member:
        live = [m for m in self._members if m.alive]
        if not live:
            raise EngineError(self.name, "no engine left in rotation")
        self._turn = (self._turn + 1) % len(live)
        rotated = live[self._turn:] + live[:self._turn]
        return min(rotated, key=lambda m: m.load)  # min keeps the first of equals: round-robin on ties

    async def _dropped_after(self, member: _Member, exc: BaseException, *, known_dead: bool = False) -> bool:
        """After ``member`` failed with ``exc``: take it out of rotation if it is dead (``known_dead``, or it
        fails ``check_alive`` now) and ``drop_dead`` is set. True when it is (now) out of rotation."""
        if not member.alive:
            return True
        if not self._drop_dead or not isinstance(exc, EngineError):
            return False
        if known_dead:
            self._drop(member, exc)
            return True
        try:
            await member.engine.check_alive()
        except EngineError as probe:
            self._drop(member, probe)
            return True
        return False  # alive: the failure was about the request, not the member

    def _drop(self, member: _Member, reason: BaseException) -> None:
        if not member.alive:
            return
        member.alive = False
        log.warning("engine %s stopped answering (%s); taken out of rotation of %s (%d of %d left)",
                    member.engine.name, reason, self.name, len(self.live), len(self._members))

    # -- weight publication ----------------------------------------------------------------------------

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        failures = await self._on_all(lambda m: m.engine.pause(mode, clear_cache))
        self._raise_failures("pause", failures)

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        """Stage once on the first live member, then let the others adopt (or redo) that staging. On any
        failure or cancellation every member that did prepare lets go of its staging before it propagates."""
        live = [m for m in self._members if m.alive]
        if not live:
            raise EngineError(self.name, "no engine left in rotation")
        first = await self._prepare_on(live[0], update)
        failed: BaseException | None = asyncio.CancelledError()  # until every member is known prepared
        async with TaskOwner(f"{self.name}-prepare") as owner:  # settled below: the owner is a backstop
            jobs = [owner.start(self._prepare_on(m, first)) for m in live[1:]]
            try:  # settle: a cancellation waits for the members' staging, so it can be let go of below
                await settle(asyncio.gather(*jobs, return_exceptions=True), "preparing the pool's members")
                failed = next((j.exception() for j in jobs if j.exception() is not None), None)
            finally:
                prepared = [(live[0], first)] + [(m, j.result()) for m, j in zip(live[1:], jobs)
                                                  if j.done() and not j.cancelled() and j.exception() is None]
                if failed is not None:  # every member that did prepare lets go of its staging
                    for member, own in prepared:
                        member.engine.release(own)
        if failed is not None:
            raise failed
        self._prepared[update.version] = prepared
        return first

    async def _prepare_on(self, member: _Member, update: WeightUpdate) -> WeightUpdate:
        try:
            return await member.engine.prepare(update)
        except WeightUpdateError as exc:
            raise WeightUpdateError(f"{self.name}: update to version {update.version} refused by "
                                    f"{[member.engine.name]} ({exc}); no member changed") from exc

    async def load(self, update: WeightUpdate) -> None:
        own = {id(m): u for m, u in self._prepared.get(update.version, [])}
        failures = await self._on_all(lambda m: m.engine.load(own.get(id(m), update)))
        if not failures:
            return
        updated = [m.engine.name for m in self._members if m.alive and m.engine.version == update.version]
        if all(isinstance(exc, WeightUpdateError) for _, exc in failures):
            raise WeightUpdateError(
                f"{self.name}: update to version {update.version} refused by {_names(failures)} "
                f"({_reasons(failures)}); those kept their weights; updated: {updated}"
            ) from failures[0][1]
        self._raise_failures(f"update to version {update.version} (updated: {updated})", failures)

    async def resume(self) -> None:
        failures = await self._on_all(lambda m: m.engine.resume())
        self._raise_failures("resume", failures)

    def release(self, update: WeightUpdate) -> None:
        for member, own in self._prepared.pop(update.version, []):
            member.engine.release(own)

    async def score(self, token_ids: Sequence[int]) -> dict[str, list[float]]:
        """Every live member's scores: each must serve what was published."""
        scores: dict[str, list[float]] = {}

        async def one(member: _Member) -> None:
            scores.update(await member.engine.score(token_ids))

        self._raise_failures("score", await self._on_all(one))
        return scores

    # -- sleep -----------------------------------------------------------------------------------------

    @property
    def sleep_level(self) -> int:
        """The deepest level a live member sleeps at; 0 when none sleeps."""
        return max(m.engine.sleep_level for m in self._live_or_all())

    async def sleep(self, level: int | None = None) -> None:
        """Every live member that sleeps does so, concurrently (at ``level``, or each at its own)."""
        failures = await self._on_all(lambda m: m.engine.sleep(level) if m.engine.sleep_level else _nothing())
        self._raise_failures("sleep", failures)

    async def wake(self) -> None:
        failures = await self._on_all(lambda m: m.engine.wake())
        self._raise_failures("wake", failures)

    async def _on_all(self, op: Callable[..., Awaitable[None]], *,
                      failure_means_dead: bool = False) -> list[tuple[_Member, BaseException]]:
        """Run ``op(member)`` on every live member concurrently; every member runs to the end whatever the others
        do. Dead members are dropped (``drop_dead``); the other failures are returned."""
        live = [m for m in self._members if m.alive]
        if not live:
            raise EngineError(self.name, "no engine left in rotation")
        results = await asyncio.gather(*(op(m) for m in live), return_exceptions=True)
        failures = []
        for member, result in zip(live, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException) and not await self._dropped_after(
                    member, result, known_dead=failure_means_dead):
                failures.append((member, result))
        if not self.live:
            raise EngineError(self.name, "every engine stopped answering")
        return failures

    def _raise_failures(self, what: str, failures: list[tuple[_Member, BaseException]]) -> None:
        if not failures:
            return
        first_member, first = failures[0]
        raise EngineError(first_member.engine.name,
                          f"{self.name}: {what} failed on {_names(failures)}: {_reasons(failures)}") from first

    # -- health and shutdown ---------------------------------------------------------------------------

    async def check_alive(self) -> None:
        """Check every live member at once. Dead ones are dropped (``drop_dead``) or reported."""
        failures = await self._on_all(lambda m: m.engine.check_alive(), failure_means_dead=True)
        self._raise_failures("health check", failures)

    async def wait_dead(self) -> EngineError:
        """Return once a live member dies (without ``drop_dead``: an error naming it) or, with ``drop_dead``,
        once the last one has (each death before it takes that member out of rotation)."""
        while True:
            live = [m for m in self._members if m.alive]
            if not live:
                return EngineError(self.name, "every engine stopped answering")
            async with TaskOwner(f"{self.name}-wait-dead") as owner:  # the waits still running end with it
                waits = {owner.start(m.engine.wait_dead()): m for m in live}
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in done:
                member, error = waits[w], w.result()
                if not self._drop_dead:
                    return EngineError(member.engine.name, f"{self.name}: member died: {error}")
                self._drop(member, error)

    async def close(self) -> None:
        results = await asyncio.gather(*(m.engine.close() for m in self._members), return_exceptions=True)
        for member, result in zip(self._members, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("closing engine %s failed: %r", member.engine.name, result)

    def _live_or_all(self) -> list[_Member]:
        return [m for m in self._members if m.alive] or self._members


async def _nothing() -> None:
    pass


def _names(failures: list[tuple[_Member, BaseException]]) -> list[str]:
    return [m.engine.name for m, _ in failures]


def _reasons(failures: list[tuple[_Member, BaseException]]) -> str:
    return "; ".join(f"{m.engine.name}: {exc}" for m, exc in failures)


class _SessionSampler(Sampler):
    """A pool's sampler for one session: the pool's, with every call routed to the session's member."""

    def __init__(self, pool: EnginePool, key: str) -> None:
        self.pool, self.key, self.name = pool, key, f"{pool.name}[{key}]"

    version = property(lambda self: self.pool.version)
    max_model_len = property(lambda self: self.pool.max_model_len)
    vocab_size = property(lambda self: self.pool.vocab_size)
    behaviour_precision = property(lambda self: self.pool.behaviour_precision)

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        return await self.pool.generate(prompt_ids, params, request_id, n, session=self.key)
