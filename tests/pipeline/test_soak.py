"""Soak runs: memory (RSS and tracemalloc) after warm-up vs at the end, queue bound, leaked tasks, balanced
books, with checkpointing on. Short versions run in CI; the ``soak``-marked long ones (``make soak``) also
write their figures to bench/results/soak_cpu.json.

Memory bounds, from the warm-up step to the end: traced Python memory outside the queue's bounded
de-duplication cache (``SEEN_IDS_LIMIT`` group ids) may grow by ``SLACK_MIB``; the cache by
``SEEN_ID_BYTES`` per id added. RSS (less tracemalloc's own bookkeeping) gets a looser bound.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import json
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

from asyncrl import LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, SamplingConfig
from asyncrl.algorithms.losses import Loss, LossOutput
from asyncrl.checkpoint import CheckpointConfig, Checkpointer, checkpoint_hook, latest
from asyncrl.engines.fake import FakeEngine
from asyncrl.pipeline import Pipeline
from asyncrl.actors.producer import Producer
from asyncrl.queues import rollout_queue as queue_module
from asyncrl.queues.rollout_queue import SEEN_IDS_LIMIT
from asyncrl.recipes import grpo_pipeline
from asyncrl.groups import RewardGroups

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "soak_cpu.json"
SLACK_MIB = 2.0  # traced growth allowed outside the de-dup cache
SEEN_ID_BYTES = 320  # allowance per group id the queue remembers (measured 120-220 B: the dict resizes)
RSS_SLACK_MIB = 48.0  # RSS is noisier (allocator arenas, worker threads): a loose bound that still catches leaks


@dataclass(slots=True)
class Mark:
    step: int
    time: float
    rss_mib: float  # this process
    children_rss_mib: float  # engine processes
    traced_mib: float
    queued: int  # groups that ever entered the queue
    snapshot: tracemalloc.Snapshot | None = None


@dataclass(slots=True)
class Figures:
    """What a soak run measured. Growth is from the warm-up step to the last step."""

    kind: str
    steps: int
    warmup: int
    steps_per_s: float  # after warm-up, with tracemalloc on (it slows Python allocations several-fold)
    rss_growth_mib: float
    children_rss_growth_mib: float
    second_half_rss_growth_mib: float  # from half-way to the end: a leak keeps growing, a warm-up flattens
    second_half_children_rss_growth_mib: float
    traced_growth_mib: float  # all traced Python memory
    traced_growth_outside_cache_mib: float  # bound: SLACK_MIB
    cache_growth_mib: float  # the queue's de-dup cache (bounded by SEEN_IDS_LIMIT ids)
    cache_bound_mib: float  # SEEN_ID_BYTES per id added
    seen_ids_growth: int  # group ids added to the de-dup cache after warm-up
    max_depth: int
    capacity: int
    unaccounted: int
    leaked_tasks: list[str]
    checkpoints: int
    dropped: dict[str, int]
    top_growth: list[str] = field(default_factory=list)  # largest tracemalloc growth sites


class MemoryProbe:
    """A learner hook marking memory (after a full collection) at the warm-up step, half-way and at the end."""

    def __init__(self, pipe: Pipeline, warmup: int, last: int) -> None:
        self.pipe, self.at, self.marks = pipe, {warmup, (warmup + last) // 2, last}, {}

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if step not in self.at:
            return
        gc.collect()
        me = psutil.Process()
        children = sum(_rss(p) for p in me.children(recursive=True))
        rss = _rss(me) - tracemalloc.get_tracemalloc_memory()  # tracemalloc's traces are not the program's
        self.marks[step] = Mark(step, time.perf_counter(), rss / 2**20, children / 2**20,
                                tracemalloc.get_traced_memory()[0] / 2**20, self.pipe.receiver.counters.entered,
                                tracemalloc.take_snapshot())


def cache_filters() -> list[tracemalloc.Filter]:
    """tracemalloc filters matching the queue's de-dup cache: its dict entries and the group ids it keeps."""
    filters = []
    for func, needle in ((queue_module._State.accept, "self.seen_ids[group.group_id]"),
                         (Producer.produce_one, "group_id = ")):
        lines, start = inspect.getsourcelines(func)
        line = start + next(i for i, text in enumerate(lines) if needle in text)
        filters.append(tracemalloc.Filter(True, inspect.getsourcefile(func), line))
    return filters


def traced_growth_mib(a: tracemalloc.Snapshot, b: tracemalloc.Snapshot, *, cache: bool) -> float:
    """Growth of traced memory inside (``cache``) or outside the de-dup cache."""
    filters = cache_filters() if cache else [tracemalloc.Filter(False, f.filename_pattern, f.lineno)
                                             for f in cache_filters()]
    diff = b.filter_traces(filters).compare_to(a.filter_traces(filters), "filename")
    return sum(s.size_diff for s in diff) / 2**20


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.NoSuchProcess:
        return 0


async def soak(kind: str, pipe: Pipeline, steps: int, warmup: int, ckpt_dir: Path, every: int) -> Figures:
    tasks_before = asyncio.all_tasks()
    probe = MemoryProbe(pipe, warmup, steps)
    tracemalloc.start()
    try:
        async with Checkpointer(CheckpointConfig(ckpt_dir, every_steps=every, keep=2)) as ckpt:
            pipe.learner.hooks += [checkpoint_hook(ckpt, pipe.learner, pipe.producers[0].prompts), probe]
            stats = await pipe.run(steps)
    finally:
        tracemalloc.stop()
    await asyncio.sleep(0)  # let finished tasks be forgotten
    leaked = sorted(t.get_name() for t in asyncio.all_tasks() - tasks_before if not t.done())
    a, mid, b = probe.marks[warmup], probe.marks[(warmup + steps) // 2], probe.marks[steps]
    seen = min(b.queued, SEEN_IDS_LIMIT) - min(a.queued, SEEN_IDS_LIMIT)
    return Figures(
        kind=kind, steps=steps, warmup=warmup, steps_per_s=round((steps - warmup) / (b.time - a.time), 1),
        rss_growth_mib=round(b.rss_mib - a.rss_mib, 2),
        children_rss_growth_mib=round(b.children_rss_mib - a.children_rss_mib, 2),
        second_half_rss_growth_mib=round(b.rss_mib - mid.rss_mib, 2),
        second_half_children_rss_growth_mib=round(b.children_rss_mib - mid.children_rss_mib, 2),
        traced_growth_mib=round(b.traced_mib - a.traced_mib, 3),
        traced_growth_outside_cache_mib=round(traced_growth_mib(a.snapshot, b.snapshot, cache=False), 3),
        cache_growth_mib=round(traced_growth_mib(a.snapshot, b.snapshot, cache=True), 3),
        cache_bound_mib=round(seen * SEEN_ID_BYTES / 2**20, 3), seen_ids_growth=seen,
        max_depth=pipe.receiver.statistics().max_depth, capacity=pipe.receiver.config.capacity,
        unaccounted=stats.unaccounted,
        leaked_tasks=leaked, checkpoints=ckpt.counters.saves, dropped=stats.dropped,
        top_growth=[str(s) for s in b.snapshot.compare_to(a.snapshot, "lineno")[:6]],
    )


def check(fig: Figures, steps: int, ckpt_dir: Path) -> None:
    print(json.dumps(asdict(fig), indent=1))
    assert fig.traced_growth_outside_cache_mib < SLACK_MIB, fig.top_growth
    assert fig.cache_growth_mib < max(fig.cache_bound_mib, 0.5), fig.top_growth
    assert fig.rss_growth_mib < RSS_SLACK_MIB + fig.cache_bound_mib
    assert fig.max_depth <= fig.capacity
    assert fig.leaked_tasks == []
    assert fig.unaccounted == 0
    assert latest(ckpt_dir).step == steps


def save_figures(fig: Figures) -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    from bench.common import hardware, versions

    machine = hardware()
    machine["loadavg_at_end"] = machine.pop("loadavg_at_start")  # read as the run ends
    results[fig.kind] = {**asdict(fig), "command": "make soak", "hardware": machine, "versions": versions(),
                         "date": time.strftime("%Y-%m-%d %H:%M")}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


# ---- FakeEngine at full speed --------------------------------------------------------------------------------


class SmallLoss(Loss):
    min_group_size = 1

    def compute(self, model, groups, **kw):
        x = torch.tensor([[float(t) for t in (g.prompt.token_ids * 4)[:4]] for g in groups])
        y = torch.tensor([sum(r.reward for r in g.rollouts) for g in groups])
        loss = (model(x).squeeze(-1) - y).square().mean()
        return LossOutput(loss=loss, metrics={"loss/policy": float(loss.detach())},
                          num_tokens=sum(g.num_tokens for g in groups))


def endless_prompts():
    for i in itertools.count():
        yield Prompt(f"p{i}", (1 + i % 7, 2 + i % 3, 3))


async def fake_soak(steps: int, warmup: int, ckpt_dir: Path, every: int) -> Figures:
    cfg = PipelineConfig(producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=4)),
                         queue=QueueConfig(capacity=8), learner=LearnerConfig(batch_groups=2), num_producers=2)
    pipe = grpo_pipeline(FakeEngine(), torch.nn.Linear(4, 1), endless_prompts(), RewardGroups(lambda p, s: 1.0), cfg,
                         loss=SmallLoss())
    return await soak("fake", pipe, steps, warmup, ckpt_dir, every)


async def test_fake_engine_soak_short(tmp_path):
    fig = await fake_soak(steps=700, warmup=200, ckpt_dir=tmp_path, every=100)
    check(fig, 700, tmp_path)


@pytest.mark.soak
async def test_fake_engine_soak_long(tmp_path):
    fig = await fake_soak(steps=30_000, warmup=1_500, ckpt_dir=tmp_path, every=500)
    save_figures(fig)
    check(fig, 30_000, tmp_path)


# ---- the real engine -------------------------------------------------------------------------------------------


async def vllm_soak(engine, model_dir, tokenizer, steps: int, warmup: int, ckpt_dir: Path, every: int) -> Figures:
    from asyncrl.testing.tasks import arithmetic
    from tests.support import load_hf_model

    def prompts():
        for i, p in enumerate(arithmetic.problems(seed=1)):
            yield Prompt(f"s{i}", tuple(tokenizer(p.prompt).input_ids), p.prompt, p.answer)

    cfg = PipelineConfig(producer=ProducerConfig(sampling=SamplingConfig(n=4, max_tokens=6)),
                         queue=QueueConfig(capacity=8, max_staleness=1),
                         learner=LearnerConfig(batch_groups=2, lr=1e-4))
    def reward(prompt, sample):  # task reward plus a term that varies within groups, so gradients are not zero
        return arithmetic.reward(sample.text, prompt.answer) + 0.1 * (sum(sample.token_ids) % 2)

    pipe = grpo_pipeline(engine, load_hf_model(model_dir), prompts(), RewardGroups(reward), cfg,
                         pad_id=tokenizer.pad_token_id,
                         close_engine=False)
    # Start the engine's own long-lived tasks (vLLM's output handler) before the task baseline is taken.
    await engine.generate((5, 6, 7), SamplingConfig(n=1, max_tokens=1), request_id="soak-warmup")
    return await soak("vllm", pipe, steps, warmup, ckpt_dir, every)


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_engine_soak_short(vllm_engine, tiny_model_dir, tokenizer, tmp_path):
    fig = await vllm_soak(vllm_engine, tiny_model_dir, tokenizer, steps=15, warmup=5, ckpt_dir=tmp_path, every=5)
    check(fig, 15, tmp_path)


@pytest.mark.soak
@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_vllm_engine_soak_long(vllm_engine, tiny_model_dir, tokenizer, tmp_path):
    fig = await vllm_soak(vllm_engine, tiny_model_dir, tokenizer, steps=1500, warmup=100, ckpt_dir=tmp_path,
                          every=100)
    save_figures(fig)
    check(fig, 1500, tmp_path)
