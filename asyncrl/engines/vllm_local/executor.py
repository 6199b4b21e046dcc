"""vLLM's multiprocess executor with queue readers that nap instead of busy-waiting (``busy_wait=False``).

vLLM passes each scheduler step to the worker, and the result back, through shared-memory queues. For a
second after every message a reader waits for the next one by spinning on ``sched_yield``
(``SpinCondition``); only after that does it sleep on a notification socket. On a GPU host that buys
microseconds. On a small CPU host it costs a core: measured here (2 cores, 4.7M-param model), EngineCore
used 0.8 of a core spinning while the worker generated, and the worker spun for a second after each
burst. A learner sharing the machine loses those cycles.

Blocking on the notification socket for every message is not an option: notifications get lost (vLLM
re-checks every 5 s for that reason), and with every message going through that path a pipeline stalled
for 5-10 s at most weight syncs. So the readers keep vLLM's one-second active window but sleep ``NAP_S``
between checks of the shared-memory flag instead of yielding: a few microseconds of CPU per check, and at
most a nap (~0.25 ms with Linux timer slack) of added latency per message.

Loaded by qualified name inside EngineCore (``distributed_executor_backend``), so it imports only vLLM and
``exit_fast``.
The worker side is switched through the worker extension (``asyncrl_stop_busy_wait``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from asyncrl.engines.vllm_local.exit_fast import exit_fast

NAP_S = 200e-6  # between checks of a queue's written flag while messages are frequent
logger = logging.getLogger(__name__)


class NappingSpinCondition(SpinCondition):
    """``SpinCondition`` whose active-period wait sleeps instead of calling ``sched_yield``."""

    def wait(self, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(NAP_S)
        else:  # idle: vLLM's own sleep on the notification socket
            super().wait(timeout_ms)


def stop_busy_wait(queue: Any) -> bool:
    """Switch one ``MessageQueue`` reader to napping; False if the queue has no reader-side spin state."""
    spin = getattr(queue, "_spin_condition", None)
    if not isinstance(spin, SpinCondition) or not spin.is_reader:
        return False
    spin.__class__ = NappingSpinCondition  # same state, only ``wait`` differs
    return True


class NappingReadersExecutor(MultiprocExecutor):
    """``MultiprocExecutor`` whose EngineCore-side and worker-side queue readers nap instead of spinning."""

    def _post_init_executor(self) -> None:
        super()._post_init_executor()
        exit_fast()  # this runs in EngineCore: its exit need not walk vLLM's heap either
        local = sum(stop_busy_wait(mq) for mq in getattr(self, "response_mqs", []))
        workers = self.collective_rpc("asyncrl_stop_busy_wait")
        logger.info("asyncrl: %d response queue(s) and %d/%d worker queue(s) switched to napping readers",
                    local, sum(bool(w) for w in workers), len(workers))
