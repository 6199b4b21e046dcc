"""Small asyncio helpers for structured concurrency and cancellation."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


def first_cause(group: BaseExceptionGroup) -> BaseException:
    """The error that stopped the run (the task group also holds the cancellations it caused)."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    for exc in leaves:
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return leaves[0]


async def together(*aws: Awaitable[Any]) -> list[Any]:
    """Run the awaitables concurrently and return their results. The first failure cancels the rest and is
    raised as itself (callers catch specific errors, not exception groups). A cancellation of the caller always
    wins: Python 3.11's TaskGroup raises a child's error in place of the caller's pending ``CancelledError`` (it
    once let a cancelled producer slot run on and wait for ever for an admission ticket)."""
    caller = asyncio.current_task()
    before = caller.cancelling() if caller is not None else 0
    # The group runs in a task of its own, so its own cancel-and-uncancel of its parent (which 3.11 leaves
    # counted) never touches the caller's count: what is left there is a real cancellation.
    group = asyncio.ensure_future(_group(aws))
    try:
        return await group
    except BaseException as exc:
        for aw in aws:  # cancelled before the group started: its coroutines were never awaited
            if inspect.iscoroutine(aw) and inspect.getcoroutinestate(aw) == inspect.CORO_CREATED:
                aw.close()
        if caller is not None and caller.cancelling() > before and not isinstance(exc, asyncio.CancelledError):
            raise asyncio.CancelledError() from exc
        raise


async def _group(aws: tuple[Awaitable[Any], ...]) -> list[Any]:
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(aw) for aw in aws]  # type: ignore[arg-type]
    except BaseExceptionGroup as group:
        raise first_cause(group) from group
    return [t.result() for t in tasks]


async def settle(aw: Awaitable[T], what: str = "operation") -> T:
    """Await ``aw`` to its end even if the caller is cancelled meanwhile, then let the cancellation through.

    For steps that must never stop half-way (loading weights and committing their version, resuming the
    engine): the caller's ``CancelledError`` is delayed until ``aw`` is done, never swallowed. If ``aw`` failed
    while the caller was being cancelled, the cancellation wins and the failure is logged and chained."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise  # ``aw`` itself was cancelled (not the caller): nothing more to wait for
            cancelled = True
        except BaseException:
            break  # ``aw`` failed; its error is raised below
    if not cancelled:
        return task.result()
    error = None if task.cancelled() else task.exception()
    if error is not None:
        log.warning("%s failed while its caller was being cancelled: %r", what, error)
    raise asyncio.CancelledError(f"cancelled during {what} (completed first)") from error


async def bounded(aw: Awaitable[T], timeout_s: float, what: str) -> T | None:
    """Await ``aw`` for at most ``timeout_s``, even if the caller is cancelled meanwhile (shutdown paths: a
    cancellation must not cut a close short, and a stuck close must not hang the caller). On timeout ``aw`` is
    cancelled, the fact logged, and None returned; a cancellation of the caller is re-raised at the end."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    deadline = loop.time() + timeout_s
    cancelled = False
    while not task.done() and (left := deadline - loop.time()) > 0:
        try:
            await asyncio.wait({task}, timeout=left)
        except asyncio.CancelledError:
            cancelled = True
    if not task.done():
        log.error("%s did not finish within %.1fs; abandoned", what, timeout_s)
        task.cancel()
    if cancelled:
        raise asyncio.CancelledError(f"cancelled during {what} (waited for it first)")
    return task.result() if task.done() and not task.cancelled() else None


CLOSE_TIMEOUT_S = 30.0  # default bound on how long ``TaskOwner.aclose`` waits for its cancelled tasks


class TaskOwner:
    """The one owner of a set of background tasks: ``start`` keeps each task until it ends; ``aclose`` (or the
    end of an ``async with`` block) cancels those still running and waits for them, for at most ``timeout_s``.

    A task's failure goes to whoever awaits the task ``start`` returned; ``on_error``, if given, is told as
    well (e.g. to log a failure nobody awaits). An owner outlives ``aclose``: tasks started after it are kept
    for the next one. ``aclose`` finishes its wait even if its caller is cancelled meanwhile, then lets the
    cancellation through (shutdown must not leave a task half-cancelled behind it)."""

    def __init__(self, name: str, *, on_error: Callable[[asyncio.Task[Any], BaseException], object] | None = None,
                 timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self.name = name  # for task names and the log
        self._on_error = on_error
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task owned here and return the task."""
        task = asyncio.get_running_loop().create_task(coro, name=name or self.name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def __len__(self) -> int:
        """Tasks started and not yet ended."""
        return len(self._tasks)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if self._on_error is not None and not task.cancelled() and task.exception() is not None:
            self._on_error(task, task.exception())  # type: ignore[arg-type]

    async def aclose(self) -> None:
        """Cancel every task still running and wait for them to end (bounded). Their errors were their
        awaiters' (or ``on_error``'s); errors of tasks ended by this close are not raised again here."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                await bounded(asyncio.wait(tasks), self._timeout_s, f"{self.name}: cancelled tasks")
        finally:
            for task in tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: the awaiter (if any) saw it, the close caused it otherwise

    async def __aenter__(self) -> TaskOwner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
