"""An in-process engine's processes die with the program that started it, even by SIGKILL.

vLLM's workers watch their EngineCore (a pipe whose end it holds), but EngineCore watches nothing of its parent:
a program killed by SIGKILL, or one that died before closing its engine, left EngineCore and its workers running
for good, holding their memory and, mid-generation, a core. So each worker watches the starter through a pidfd
(``VLLMEngine.start`` passes its pid once the engine is up). When the starter exits, the worker SIGTERMs
EngineCore (vLLM's own shutdown, which ends the workers through their pipe) and SIGKILLs what is left after
``GRACE_S``. Nothing polls: the watching thread blocks until the pidfd becomes readable.

Why a pidfd: it names exactly the starter's process. ``PR_SET_PDEATHSIG`` fires when the parent *thread* ends
(engines are started from an event loop's worker thread), and a pipe inherited by a child the starter forks
would keep the engine alive as long as that child lives. Linux >= 5.3; elsewhere the watch is skipped, with a
warning.

Runs in a vLLM worker process, so it imports the standard library only.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

GRACE_S = 5.0  # for EngineCore's own shutdown, after the SIGTERM
log = logging.getLogger(__name__)


def die_with(starter: int) -> bool:
    """From a worker: end this engine's processes when ``starter`` exits. Returns whether a watch started."""
    me = os.getpid()
    if starter == me:  # vLLM without multiprocessing: the engine lives and dies in the starter itself
        return False
    parent = os.getppid()
    # EngineCore, when it is a process of its own (the worker's parent), then this worker; a worker that runs
    # inside EngineCore (one GPU, in-process executor) is EngineCore.
    targets = [parent, me] if parent not in (starter, 1) else [me]
    try:
        fd = os.pidfd_open(starter)
    except ProcessLookupError:  # the starter is gone already
        threading.Thread(target=_end, args=(targets,), name="asyncrl-starter-gone", daemon=True).start()
        return True
    except (OSError, AttributeError) as e:  # no pidfd here
        log.warning("asyncrl: cannot watch the engine's starter (pid %d): %s; the engine will outlive a killed "
                    "starter", starter, e)
        return False
    threading.Thread(target=_watch, args=(fd, targets), name="asyncrl-starter-watch", daemon=True).start()
    return True


def _watch(fd: int, targets: list[int]) -> None:
    select.select([fd], [], [])  # readable once the starter has exited
    os.close(fd)
    _end(targets)


def _end(targets: list[int]) -> None:
    _signal(targets[0], signal.SIGTERM)
    time.sleep(GRACE_S)  # a daemon thread: if the shutdown ends this process first, nothing more happens
    for pid in targets:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
