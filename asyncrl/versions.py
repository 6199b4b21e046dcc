"""The policy's weight versions, owned by one clock and announced as events.

Version 0 is the initial policy; every publication makes ``served + 1`` (or a version given explicitly, when a
run resumes from a checkpoint). Two numbers matter:

- ``served``: the version the engines sample with. It moves only when a publication has fully landed, inside
  the same uncancellable step that loads the weights, so the engines and the learner never disagree.
- ``policy``: the version of the weights the learner is training from. It runs one ahead of ``served`` while a
  publication is in flight (with ``SyncConfig.overlap`` the learner keeps training meanwhile). Staleness is
  measured against it, so a group sampled right after a publication landed is 0 versions old, never -1.

Components that care (the rollout queue drops groups that became too stale) subscribe with ``observe``
instead of having versions passed through every call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

VersionObserver = Callable[["VersionClock"], None]


class VersionClock:
    """``served`` and ``policy`` versions, with observers called synchronously on every change."""

    __slots__ = ("_served", "_pending", "_observers")

    def __init__(self, served: int = 0) -> None:
        if not isinstance(served, int) or isinstance(served, bool) or served < 0:
            raise ValueError(f"a weight version is an integer >= 0, got {served!r}")
        self._served = served
        self._pending: int | None = None  # the version being published, if any
        self._observers: list[VersionObserver] = []

    @property
    def served(self) -> int:
        """The version the engines sample new tokens with."""
        return self._served

    @property
    def pending(self) -> int | None:
        """The version being published right now, or None."""
        return self._pending

    @property
    def policy(self) -> int:
        """The version of the learner's weights: ``pending`` while a publication is in flight, else ``served``."""
        return self._served if self._pending is None else self._pending

    def observe(self, observer: VersionObserver) -> Callable[[], None]:
        """Call ``observer(clock)`` after every change; returns a function that unsubscribes it."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    def begin(self, version: int) -> None:
        """A publication of ``version`` starts (called by ``WeightSync``)."""
        if self._pending is not None:
            raise RuntimeError(f"version {version} published while {self._pending} is still in flight")
        if version <= self._served:
            raise ValueError(f"version {version} is not newer than the served version {self._served}")
        self._pending = version
        self._notify()

    def commit(self, version: int) -> None:
        """The publication of ``version`` landed in every engine."""
        if self._pending != version:
            raise RuntimeError(f"commit of version {version}, but {self._pending} is the one in flight")
        self._served, self._pending = version, None
        self._notify()

    def abandon(self, version: int) -> None:
        """The publication of ``version`` failed or was cancelled; the engines still serve ``served``."""
        if self._pending == version:
            self._pending = None
            self._notify()

    def _notify(self) -> None:
        for observer in list(self._observers):
            try:
                observer(self)
            except Exception:  # an observer's bug must not stop a publication half-way
                log.exception("version observer %r failed", observer)

    def __repr__(self) -> str:
        return f"VersionClock(served={self._served}, pending={self._pending})"
