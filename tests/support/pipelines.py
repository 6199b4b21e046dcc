"""Shared by the pipeline tests (not fixtures): on the FakeEngine, prompts, a recording loss, a pipeline and its
config, and a sender that says when the queue is full; on the real vLLM engine, the arithmetic task's prompts and
reward, a config, a recording GRPO loss, a pipeline and a check that no child process is left; and a probe of the
event loop's lag with a reward that blocks."""

from __future__ import annotations

import asyncio
import threading
import time

import psutil
import torch

from asyncrl import (
    AbortPolicy, InvalidGroupPolicy, LearnerConfig, PauseMode, PipelineConfig, ProducerConfig, Prompt, QueueConfig,
    SamplingConfig, SyncConfig,
)
from asyncrl.algorithms.losses import GRPOLoss, Loss, LossConfig, LossOutput
from asyncrl.recipes import grpo_pipeline
from asyncrl.testing.tasks import arithmetic
from asyncrl.groups import RewardGroups
from tests.support import child_pids, describe, load_hf_model

# -- on the FakeEngine ------------------------------------------------------------------------------------------


def prompts(count: int, length: int = 3):
    return [Prompt(f"p{i}", tuple(range(1, length + 1)), answer=i) for i in range(count)]


class RecordingLoss(Loss):
    """A loss that records what reached it (and optionally waits on a gate, to make a slow learner)."""

    min_group_size = 1

    def __init__(self, learner_version=lambda: 0, gate: threading.Event | None = None) -> None:
        self.seen: list[tuple[int, int]] = []  # (learner version, group staleness)
        self.version = learner_version
        self.gate = gate
        self.param = torch.nn.Parameter(torch.zeros(1))

    def compute(self, model, groups, **kw):
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"
        v = self.version()
        self.seen.extend((v, g.staleness(v)) for g in groups)
        loss = (model.weight.sum() * 0 + sum(r.reward for g in groups for r in g.rollouts) * 0.0)
        return LossOutput(loss=loss, metrics={"loss/policy": 0.0}, num_tokens=sum(g.num_tokens for g in groups))


def tiny_model():
    return torch.nn.Linear(2, 2)


def make_pipeline(engine, items, config, reward=lambda p, s: 1.0, loss=None):
    model = tiny_model()
    pipe = grpo_pipeline(engine, model, items, RewardGroups(reward), config, loss=loss or RecordingLoss())
    if isinstance(pipe.learner.loss, RecordingLoss):
        pipe.learner.loss.version = lambda: pipe.learner.version
    return pipe


def config(**kw) -> PipelineConfig:
    sampling = SamplingConfig(n=kw.pop("n", 2), max_tokens=kw.pop("max_tokens", 4))
    return PipelineConfig(
        producer=ProducerConfig(sampling=sampling, max_inflight_groups=kw.pop("inflight", 4),
                                on_invalid=kw.pop("on_invalid", InvalidGroupPolicy.DROP),
                                on_abort=kw.pop("on_abort", AbortPolicy.RESUBMIT)),
        queue=QueueConfig(capacity=kw.pop("capacity", 8), max_staleness=kw.pop("max_staleness", 1),
                          admission=kw.pop("admission", True)),
        learner=LearnerConfig(batch_groups=kw.pop("batch", 2), sync=SyncConfig(every=kw.pop("every", 1))),
        num_producers=kw.pop("producers", 1),
    )


class SignallingSink:
    """A producer's sender that sets ``full`` when a send is about to block on the full queue."""

    def __init__(self, sender, receiver, full: asyncio.Event) -> None:
        self.sender, self.receiver, self.full = sender, receiver, full

    async def send(self, g, *, ticket=None):
        if self.receiver.depth >= self.receiver.config.capacity:
            self.full.set()
        return await self.sender.send(g, ticket=ticket)

    async def aclose(self) -> None:
        await self.sender.aclose()


# -- on the real vLLM engine ------------------------------------------------------------------------------------


def task_prompts(tokenizer, count: int = 2000):
    train, _ = arithmetic.split(count, 0)
    return [Prompt(f"q{i}", tuple(tokenizer(p.prompt).input_ids), p.prompt, p.answer) for i, p in enumerate(train)]


def reward(prompt, sample) -> float:
    return arithmetic.reward(sample.text, prompt.answer)


def pipeline_config(*, mode=PauseMode.KEEP, max_staleness=1, capacity=8, batch=2, inflight=4, every=1,
                    admission=True):
    return PipelineConfig(
        producer=ProducerConfig(sampling=SamplingConfig(n=4, max_tokens=6), max_inflight_groups=inflight),
        queue=QueueConfig(capacity=capacity, max_staleness=max_staleness, admission=admission),
        # Every group reaches the loss (the tiny random model earns no reward, so all groups would be inert
        # and skipped), so the recording loss sees what the learner trained on.
        learner=LearnerConfig(batch_groups=batch, lr=1e-4, skip_inert_groups=False,
                              sync=SyncConfig(every=every, mode=mode)),
    )


class Recording(GRPOLoss):
    """The real GRPO loss, recording each group's staleness as the learner saw it (and optionally gated)."""

    def __init__(self, tokenizer, gate: threading.Event | None = None) -> None:
        super().__init__(LossConfig(), pad_id=tokenizer.pad_token_id)
        self.learner = None
        self.staleness: list[int] = []
        self.gate = gate

    def compute(self, model, groups, **kw):
        if self.gate is not None:
            assert self.gate.wait(60), "test gate never opened"
        self.staleness.extend(g.staleness(self.learner.version) for g in groups)
        return super().compute(model, groups, **kw)


def build(engine, model_dir, tokenizer, config, loss=None, reward_fn=reward, close_engine=False):
    pipe = grpo_pipeline(engine, load_hf_model(model_dir), task_prompts(tokenizer), RewardGroups(reward_fn), config,
                         loss=loss, pad_id=tokenizer.pad_token_id, close_engine=close_engine)
    if isinstance(loss, Recording):
        loss.learner = pipe.learner
    return pipe


def _assert_no_children(before: set[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    leftover = child_pids() - before
    while leftover and time.monotonic() <= deadline:
        psutil.wait_procs([psutil.Process(p) for p in leftover if psutil.pid_exists(p)], timeout=0.5)
        leftover = child_pids() - before
    assert not leftover, f"processes left behind: {describe(leftover)}"


# -- the event loop's lag ---------------------------------------------------------------------------------------


class LoopLag:
    """The longest the event loop was late to wake a task that sleeps ``tick_s`` at a time."""

    def __init__(self, tick_s: float = 0.005) -> None:
        self.tick_s, self.worst = tick_s, 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.tick_s)
            self.worst = max(self.worst, loop.time() - t0 - self.tick_s)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def slow_reward(prompt, sample) -> float:
    time.sleep(0.2)  # a reward that calls a slow checker synchronously
    return 1.0
