"""``RolloutLog``: the learner's recorder, writing every trained batch to the log from its own thread.

The event loop only hands a step over: the groups are frozen, so the writer thread reads them as they are, and
turning them into Arrow and writing happens there. At most ``max_pending_steps`` steps wait for the thread; the
learner's next ``record`` waits beyond that (backpressure), so the log never drops a step. A failed write fails
the next ``record`` (or ``aclose``) with its error. ``aclose`` finishes what was handed over and closes the file;
the learner calls it on every way out of a run, cancellation included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from pydantic import TypeAdapter

from asyncrl.algorithms.losses import LossConfig
from asyncrl.config import LearnerConfig, PipelineConfig, RolloutLogConfig, SamplingConfig
from asyncrl.counters import Drops, GroupTotals
from asyncrl.rollout_log.files import LogFiles, RolloutLogError
from asyncrl.rollout_log.schema import StepRecord
from asyncrl.types import DropReason, RolloutGroup


class RolloutLog:
    """Records steps into ``files``; the learner's ``StepRecorder``. Also the queue's drop observer (``dropped``)."""

    def __init__(self, files: LogFiles, max_pending_steps: int = 4) -> None:
        self.files = files
        self._room = asyncio.Semaphore(max_pending_steps)
        self._thread: ThreadPoolExecutor | None = None
        self._pending: set[asyncio.Future[int]] = set()
        self._failure: BaseException | None = None
        self._drops_seen = Drops()  # the books' drops as of the previous step
        self._dropped: list[tuple[str, DropReason]] = []  # ids the queue dropped since the previous step
        self.steps = 0  # steps written
        self.bytes = 0  # the log's size on disk after the last write
        self.wait_s = 0.0  # time ``record`` waited for the writer (backpressure), seconds

    @classmethod
    def open(cls, config: RolloutLogConfig, header: Mapping[str, Any]) -> RolloutLog:
        """A log writing into ``config.dir``, its files carrying ``header`` (what a replay rebuilds from)."""
        return cls(LogFiles(config, {**header, "model_dir": config.model_dir}), config.max_pending_steps)

    def dropped(self, reason: DropReason, groups: Sequence[RolloutGroup]) -> None:
        """The queue dropped ``groups``: their ids go into the next step's record."""
        self._dropped.extend((g.group_id, reason) for g in groups)

    async def record(self, step: int, policy_version: int, served_version: int, batch: Sequence[RolloutGroup],
                     metrics: Mapping[str, float], totals: GroupTotals) -> None:
        """Hand step ``step`` (its batch trained at ``policy_version``) to the writer; waits only while
        ``max_pending_steps`` steps are pending. Raises the error of a write that failed earlier."""
        self._raise_failure()
        t0 = time.perf_counter()
        await self._room.acquire()
        self.wait_s += time.perf_counter() - t0
        drops = Drops({r: n - self._drops_seen[r] for r, n in totals.dropped.items() if n > self._drops_seen[r]})
        self._drops_seen = Drops(totals.dropped)
        dropped, self._dropped = self._dropped, []
        record = StepRecord(step, policy_version, served_version, tuple(batch), drops, tuple(dropped),
                            dict(metrics), time.time())
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-rollout-log")
        future = asyncio.wrap_future(self._thread.submit(self.files.write, record))
        self._pending.add(future)
        future.add_done_callback(self._written)

    def _written(self, future: asyncio.Future[int]) -> None:
        self._pending.discard(future)
        self._room.release()
        if future.cancelled():
            return
        if (error := future.exception()) is not None:
            self._failure = self._failure or error
        else:
            self.steps += 1
            self.bytes = future.result()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            error, self._failure = self._failure, None
            if isinstance(error, RolloutLogError):
                raise error
            raise RolloutLogError(f"the rollout log could not be written: {error!r}") from error

    async def aclose(self) -> None:
        """Write what was handed over, close the file and end the thread (off the event loop); raises a write's
        error not raised yet. Recording again opens a new file."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            if self._pending:
                await asyncio.wait(set(self._pending))
            done: Future[None] = thread.submit(self.files.close)
            await asyncio.wrap_future(done)
        finally:
            await asyncio.to_thread(thread.shutdown)
        self._raise_failure()

    def metrics(self) -> dict[str, float]:
        return {"rollout_log/steps": self.steps, "rollout_log/bytes": self.bytes,
                "rollout_log/pending": len(self._pending), "rollout_log/wait_s": self.wait_s}


def run_header(config: PipelineConfig, loss_config: LossConfig | None, pad_id: int,
               dtype: str | None) -> dict[str, Any]:
    """What a replay rebuilds the learner's step from (``schema`` module docstring): ``loss_config`` is the GRPO
    loss's (None: a loss of the caller's own), ``dtype`` the model's parameters'."""
    sampling = config.producer.sampling
    loss = None if loss_config is None else {
        "kind": "grpo", "config": TypeAdapter(LossConfig).dump_python(loss_config, mode="json"),
        "sampling": TypeAdapter(SamplingConfig).dump_python(sampling, mode="json"), "pad_id": pad_id}
    return {"learner": TypeAdapter(LearnerConfig).dump_python(config.learner, mode="json"), "loss": loss,
            "dtype": dtype, "max_staleness": config.queue.max_staleness, "created": time.time(),
            # CPU reductions split over threads: a bit-identical replay runs with as many
            "torch_threads": torch.get_num_threads()}
