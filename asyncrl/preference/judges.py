"""Pairwise judges: which of two completions of one prompt is better.

A judge is any callable ``judge(prompt, a, b)``, synchronous or ``async``, returning the probability that ``a``
is preferred to ``b``: 1.0 (``a`` wins), 0.0 (``b`` wins), 0.5 (a tie), or anything between; ``True``/``False``
count as 1.0/0.0. It runs exactly as a reward function does (``asyncrl.groups.scoring``): a synchronous judge in
worker threads under ``ProducerConfig.reward_threads``, an async one on the loop, every group's comparisons
bounded by ``reward_timeout_s``; a judge that raises, times out or returns something else drops its group under
``judge_error``, ``judge_timeout`` or ``judge_invalid``.

Three adapters build judges from what users already have:

- ``judge_from_reward``: a scalar reward function, compared (the demo's task: the exact answer decides);
- ``RewardModelJudge``: a transformers sequence-classification reward model, scored in a thread of its own,
  never on the event loop; the preference is the Bradley-Terry probability ``sigmoid(s_a - s_b)``;
- ``HttpJudge``: a remote judge over HTTP (an LLM judge behind a service).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from asyncrl.groups.scoring import RewardFn
from asyncrl.errors import ConfigError
from asyncrl.http.client import JSONClient
from asyncrl.types import Prompt, Sample

__all__ = ["HttpJudge", "JudgeFn", "RewardModelJudge", "judge_from_reward"]

JudgeFn = Callable[[Prompt, Sample, Sample], "float | bool | Awaitable[float | bool]"]


def judge_from_reward(reward_fn: RewardFn, *, margin: float = 0.0) -> JudgeFn:
    """A judge preferring the completion with the higher reward; rewards within ``margin`` tie (0.5). An async
    ``reward_fn`` gives an async judge (its two rewards computed concurrently)."""
    if not margin >= 0:
        raise ConfigError("judge_from_reward.margin", f"must be >= 0, got {margin!r}")

    def verdict(ra: float, rb: float) -> float:
        return 0.5 if abs(ra - rb) <= margin else 1.0 if ra > rb else 0.0

    if inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(getattr(reward_fn, "__call__", None)):
        async def async_judge(prompt: Prompt, a: Sample, b: Sample) -> float:
            ra, rb = await asyncio.gather(reward_fn(prompt, a), reward_fn(prompt, b))  # type: ignore[arg-type]
            return verdict(float(ra), float(rb))

        return async_judge

    def judge(prompt: Prompt, a: Sample, b: Sample) -> float:
        return verdict(float(reward_fn(prompt, a)), float(reward_fn(prompt, b)))  # type: ignore[arg-type]

    return judge


class RewardModelJudge:
    """A sequence-classification reward model (one logit per sequence) as a judge: ``sigmoid(s_a - s_b)``.

    The model scores ``prompt.text + completion.text`` in a thread of its own (one at a time: a model is one
    device's work), so the event loop never waits on it. ``close`` stops the thread."""

    def __init__(self, model: str | Path | Any, tokenizer: Any = None, *, max_length: int = 1024,
                 device: str = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model, str | Path):
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model))
            model = AutoModelForSequenceClassification.from_pretrained(str(model))
        if tokenizer is None:
            raise ConfigError("RewardModelJudge.tokenizer", "a model object needs its tokenizer")
        if getattr(model.config, "num_labels", 1) != 1:
            raise ConfigError("RewardModelJudge.model", f"a reward model has one output, this one has "
                                                        f"{model.config.num_labels} labels")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.device = device
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="reward-model-judge")

    async def __call__(self, prompt: Prompt, a: Sample, b: Sample) -> float:
        loop = asyncio.get_running_loop()
        sa, sb = await loop.run_in_executor(self._thread, self.scores, [prompt.text + a.text, prompt.text + b.text])
        return 1.0 / (1.0 + math.exp(-(sa - sb)))

    def scores(self, texts: list[str]) -> list[float]:
        """The model's scalar score of each text (in the calling thread)."""
        import torch

        batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                               max_length=self.max_length).to(self.device)
        with torch.no_grad():
            return [float(x) for x in self.model(**batch).logits[:, 0]]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class HttpJudge:
    """A remote judge: ``POST {url}{path}`` with ``{"prompt": str, "a": str, "b": str}`` (texts), answered by
    ``{"p": float}`` (the probability that ``a`` wins) or ``{"winner": "a" | "b" | "tie"}``. A refused request
    or a malformed answer raises, so the group is dropped under ``judge_error`` and counted."""

    def __init__(self, url: str, token: str, *, path: str = "/judge", timeout_s: float = 30.0) -> None:
        self._client = JSONClient(url, token, owner="HttpJudge", timeout_s=timeout_s)
        self._path = path

    async def __call__(self, prompt: Prompt, a: Sample, b: Sample) -> float:
        reply = await self._client.call("POST", self._path, {"prompt": prompt.text, "a": a.text, "b": b.text})
        if not reply.ok:
            raise RuntimeError(f"judge at {self._client.base_url}{self._path} answered {reply.status}: {reply.error}")
        body = reply.body
        if "p" in body and type(body["p"]) in (int, float):
            return float(body["p"])
        winner = body.get("winner")
        if winner in ("a", "b", "tie"):
            return {"a": 1.0, "b": 0.0, "tie": 0.5}[winner]
        raise RuntimeError(f"judge answer {body!r} has neither a number 'p' nor a 'winner' of a, b or tie")

    async def close(self) -> None:
        await self._client.close()
