"""Environment variables an engine's start-up needs, set for that start-up only."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

_LOCK = threading.Lock()  # two start-ups in threads must not restore each other's variables midway


@contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment for the block (the processes it spawns inherit them),
    then put back what was there before."""
    with _LOCK:
        before = {key: os.environ.get(key) for key in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for key, old in before.items():
                if old is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = old
