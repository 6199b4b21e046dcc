"""The shutdown handshake of a service with producers inside, all in this process: a producer, a
``RemoteQueueClient``, a ``RolloutIngestServer``, a learner and ``EngineControl`` in front of a ``FakeEngine``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.actors.learner import Learner
from asyncrl.actors.producer import Producer
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.algorithms.losses import Loss, LossOutput
from asyncrl.config import LearnerConfig, ProducerConfig, QueueConfig, SamplingConfig, SyncConfig
from asyncrl.data import PromptSource
from asyncrl.engines.embedded import ControlError, EngineControl, RemoteControlEngine
from asyncrl.engines.fake import FakeEngine
from asyncrl.engines.protocols import Engine
from asyncrl.engines.vllm_remote.process import free_port
from asyncrl.engines.weights import read_manifest
from asyncrl.queues.ingest_client import RemoteQueueClient
from asyncrl.queues.ingest_server import IngestServerConfig, RolloutIngestServer
from asyncrl.queues.rollout_queue import create_rollout_queue
from asyncrl.types import PauseMode, Prompt, RolloutGroup
from asyncrl.versions import VersionClock
from asyncrl.groups import RewardGroups
from tests.support.embedded import TOKEN, WAIT_S, CheckedFakeEngine, call, control_server, model_with_weights, weights

pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return model_with_weights(tmp_path)


async def rollouts(control: EngineControl, engine: Engine, body: Callable[[], Any]) -> None:
    """The service's RL part, as ``asyncrl/examples/embedded_service.py`` runs it: the engine is attached while
    ``body`` (the producer) runs and closed once it is detached."""
    try:
        async with control.serving(engine):
            await body()
    finally:
        await engine.close()


@pytest.mark.timeout(30)
async def test_a_service_stopping_mid_publication_keeps_its_engine_until_the_learner_resumes(
        model_dir: Path, staging: Path) -> None:
    """The service stops its rollouts (SIGTERM, or its producer ended) while the learner is loading weights.
    The engine and its routes stay up until the learner's resume. (Before the handshake the service detached
    and closed its engine at once, and the learner's sync failed with "HTTP 503: engine not started yet".)"""
    engine = CheckedFakeEngine(read_manifest(model_dir), gate=asyncio.Event())
    async with control_server(None) as (url, control):
        service = asyncio.create_task(rollouts(control, engine, asyncio.Event().wait))  # produces until stopped
        remote = await RemoteControlEngine.connect(url, TOKEN, model_dir, staging_dir=staging, ready_timeout_s=WAIT_S)
        sync = WeightSync(remote, VersionClock(remote.version), SyncConfig(mode="keep"))
        publishing = asyncio.create_task(sync.publish(weights(seed=1)))
        await asyncio.wait_for(engine.loading.wait(), WAIT_S)  # paused, and loading
        service.cancel()  # the service stops its RL part now
        await asyncio.sleep(0)
        assert control.engine is engine and not engine.closed  # held: the learner has a pause
        late = asyncio.create_task(call(url, "POST", "pause", {"mode": "keep", "clear_cache": False}))
        engine.gate.set()
        timing = await asyncio.wait_for(publishing, WAIT_S)
        assert (await asyncio.wait_for(late, WAIT_S))[0] == 503  # no new pause once the engine is going
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(service, WAIT_S)
        assert timing.version == engine.version == remote.version == 1
        assert engine.calls == ["pause", "load1", "resume", "close"] and engine.released == [1]
        assert await call(url, "GET", "version") == (503, {"error": "engine closed: the service is shutting "
                                                                    "down its rollouts"})
        with pytest.raises(ControlError, match="HTTP 503: engine closed"):  # a clear error for a late learner
            await remote.pause(PauseMode.KEEP, True)
        await remote.close()


@pytest.mark.timeout(30)
async def test_detach_resumes_a_pause_the_learner_never_releases() -> None:
    engine = FakeEngine()
    async with control_server(engine) as (url, control):
        assert (await call(url, "POST", "pause", {"mode": "keep", "clear_cache": False}))[0] == 200
        assert await asyncio.wait_for(control.detach(release_timeout_s=0.1), WAIT_S) is engine
        assert engine._running.is_set() and not control.paused and control.engine is None
        assert await control.detach() is None  # idempotent


async def _fail() -> None:
    raise RuntimeError("boom")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("ending", "error"), [
    ("finished", "engine closed: the rollouts finished (their producer ended, e.g. the learner closed its queue); "
                 "the service keeps serving"),
    ("failed", "engine closed: the rollouts failed (RuntimeError); the service keeps serving"),
    ("stopped", "engine closed: the service is shutting down its rollouts"),
])
async def test_the_503_after_the_engine_went_says_how_the_rollouts_ended(ending: str, error: str) -> None:
    """A late learner is told what happened: its run finished, the rollouts failed, or the service is stopping
    (the message once said "shutting down" after a normal end, while the service went on serving)."""
    engine = FakeEngine()
    async with control_server(None) as (url, control):
        body = {"finished": asyncio.sleep, "failed": _fail, "stopped": asyncio.Event().wait}[ending]
        service = asyncio.create_task(rollouts(control, engine, lambda: body(0) if ending == "finished" else body()))
        await asyncio.wait_for(_attached(control), WAIT_S)
        if ending == "stopped":
            service.cancel()
        await asyncio.gather(service, return_exceptions=True)
        assert engine.closed and await call(url, "GET", "version") == (503, {"error": error})
        assert await call(url, "GET", "health", token=None) == (503, {"error": error})


async def _attached(control: EngineControl) -> None:
    while control.engine is None:
        await asyncio.sleep(0.01)


class ZeroLoss(Loss):
    """A loss with a zero gradient: the test is about what crosses the wire, not about learning."""

    min_group_size = 1

    def compute(self, model: torch.nn.Module, groups: Sequence[RolloutGroup], **kw: object) -> LossOutput:
        zero = sum(p.sum() for p in model.parameters()) * 0.0
        return LossOutput(loss=zero, metrics={}, num_tokens=sum(g.num_tokens for g in groups))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stop", ["steps_done", "cancelled_mid_publication"])
async def test_the_learner_closing_its_queue_ends_the_service_producer_then_its_engine(
        stop: str, tmp_path: Path, staging: Path) -> None:
    """The whole handshake with both processes' parts in one: a learner stops (its steps are done, or it is
    cancelled mid-publication as Ctrl-C does); its last publication lands first, then its queue closes, the
    service's producer hears "queue closed" and returns normally, and only then does the engine close."""
    torch.manual_seed(0)
    model = Net()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    engine = CheckedFakeEngine(read_manifest(tmp_path), gate=asyncio.Event() if stop != "steps_done" else None)
    items = (Prompt(f"p{i}", (1, 2, 3), answer=i) for i in range(100_000))
    producer_config = ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=3), max_inflight_groups=2)
    sinks: list[RemoteQueueClient] = []
    ingest_url = f"http://127.0.0.1:{free_port()}"

    async def produce() -> None:  # starts before the learner listens: its first posts are refused and retried
        async with RemoteQueueClient(ingest_url, TOKEN, backoff_s=0.05, max_retries=50, max_backoff_s=0.2) as sink:
            sinks.append(sink)
            await Producer(engine, PromptSource(items), RewardGroups(lambda p, s: 1.0), sink, producer_config).run()

    async with control_server(None) as (url, control):
        service = asyncio.create_task(rollouts(control, engine, produce))
        # The learner process, as asyncrl/examples/remote_learner.py: the engine's version first, then the queue.
        remote = await RemoteControlEngine.connect(url, TOKEN, tmp_path, staging_dir=staging, ready_timeout_s=WAIT_S)
        clock = VersionClock(remote.version)
        sender, receiver = create_rollout_queue(QueueConfig(capacity=4, max_staleness=4), clock)
        config = IngestServerConfig(token=TOKEN, port=int(ingest_url.rsplit(":", 1)[1]))
        async with RolloutIngestServer(sender, config, queue_metrics=receiver.metrics) as ingest:
            learner = Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroLoss(), receiver,
                              WeightSync(remote, clock, SyncConfig(mode="keep")), LearnerConfig(batch_groups=2))
            training = asyncio.create_task(learner.run(2))
            try:
                if stop == "steps_done":
                    await asyncio.wait_for(training, WAIT_S)
                else:
                    await asyncio.wait_for(engine.loading.wait(), WAIT_S)
                    training.cancel()  # Ctrl-C while the first publication is loading
                    engine.gate.set()
                    with pytest.raises(asyncio.CancelledError):
                        await asyncio.wait_for(training, WAIT_S)
            finally:
                receiver.close()  # the learner's queue closes only after its last publication
        # Leaving the ingest server waited for the producer to hear "queue closed".
        assert ingest.unnotified() == [] and ingest.counters["http_503"] >= 1
        await asyncio.wait_for(service, WAIT_S)  # the producer returned normally: no error, no retries
        await remote.close()
    versions = 2 if stop == "steps_done" else 1
    assert clock.served == engine.version == remote.version == versions and sinks[0].queue_closed
    assert engine.calls[-2:] == ["resume", "close"] and engine.closed
    assert engine.released == engine.prepared == list(range(1, versions + 1))  # nothing left staged
    assert list(staging.iterdir()) == [] and not control.paused


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cut", ["during_the_load", "during_the_pause"])
async def test_a_cancelled_publication_says_whether_it_landed(cut: str, model_dir: Path, staging: Path) -> None:
    """A stop's cancellation arriving during the load waits for it, and the load commits: the caller gets
    ``CancelledError``, and the outcome says the version moved, counted as published (it used to count as a
    failure although the service and the clock serve the new version). Cut during the pause, nothing lands."""
    engine = CheckedFakeEngine(read_manifest(model_dir), gate=asyncio.Event())
    pausing, held = asyncio.Event(), asyncio.Event()

    async def held_pause(mode: PauseMode, clear_cache: bool) -> None:
        pausing.set()
        await held.wait()

    if cut == "during_the_pause":
        engine.pause = held_pause  # type: ignore[method-assign]
    async with control_server(engine) as (url, control):
        remote = await RemoteControlEngine.connect(url, TOKEN, model_dir, staging_dir=staging, ready_timeout_s=WAIT_S)
        sync = WeightSync(remote, VersionClock(remote.version), SyncConfig(mode="keep"))
        publishing = asyncio.create_task(sync.publish(weights(seed=1)))
        started, gate = (engine.loading, engine.gate) if cut == "during_the_load" else (pausing, held)
        await asyncio.wait_for(started.wait(), WAIT_S)
        publishing.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(publishing, WAIT_S)
        landed = cut == "during_the_load"
        assert sync.outcome is not None and sync.outcome.version == 1 and sync.outcome.landed is landed
        assert isinstance(sync.outcome.error, asyncio.CancelledError)
        assert (sync.clock.served, engine.version, remote.version) == ((1, 1, 1) if landed else (0, 0, 0))
        assert (sync.counters.published, sync.counters.failures) == ((1, 0) if landed else (0, 1))
        assert control.counters["weights_200"] == int(landed) and not control.paused
        await remote.close()
