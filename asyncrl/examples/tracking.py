"""Watching an example run: held-out accuracy with greedy decoding through a running ``VLLMEngine``
(temperature 0 on its ``AsyncLLM``: ``SamplingConfig`` requires temperature > 0), the learner hooks (periodic
evaluation as ``eval/accuracy``, a learning-rate schedule, a tqdm progress bar), and the run plot."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.examples.common import Example, RewardFn, Task, encode_prompt


async def engine_greedy_accuracy(engine: Any, tok: Any, problems: Sequence[Example], reward: RewardFn,
                                 max_tokens: int, batch: str = "eval") -> float:
    """Held-out accuracy with greedy decoding (temperature 0) on ``engine``'s current weights.

    Runs beside training requests; nothing is paused. Goes through ``engine.llm`` (a ``VLLMEngine``'s
    ``AsyncLLM``) because ``SamplingConfig`` refuses temperature 0.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(i: int, ex: Example) -> float:
        final = None
        ids = list(encode_prompt(tok, ex.prompt))
        async for out in engine.llm.generate({"prompt_token_ids": ids}, params, request_id=f"eval-{batch}-{i}"):
            final = out
        return reward(final.outputs[0].text, ex.answer) if final is not None else 0.0

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(i, ex)) for i, ex in enumerate(problems)]
    return sum(t.result() for t in tasks) / max(1, len(problems))


class EvalHook:
    """Every ``every`` steps, measure held-out greedy accuracy on the engine and add it as ``eval/accuracy``.

    The learner waits for the evaluation (producers keep generating). ``seconds`` totals the time spent
    here; ``points`` holds ``(step, accuracy, clock_s)`` where ``clock_s`` is the time since the hook was
    created minus the evaluation time before it, i.e. the training wall time at which the weights were
    measured.
    """

    def __init__(self, engine: Any, tok: Any, task: Task, max_tokens: int, every: int) -> None:
        self.engine, self.tok, self.task, self.max_tokens, self.every = engine, tok, task, max_tokens, every
        self.seconds = 0.0
        self.points: list[tuple[int, float, float]] = []
        self.t0 = time.perf_counter()
        self._evals = itertools.count()  # request ids must differ between evaluations

    async def evaluate(self, step: int) -> float:
        t0 = time.perf_counter()
        acc = await engine_greedy_accuracy(self.engine, self.tok, self.task.held_out, self.task.reward,
                                           self.max_tokens, batch=f"eval{next(self._evals)}")
        self.points.append((step, acc, t0 - self.t0 - self.seconds))
        self.seconds += time.perf_counter() - t0
        return acc

    async def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if self.every > 0 and step % self.every == 0:
            metrics["eval/accuracy"] = await self.evaluate(step)


def lr_schedule(optimizer: Any, warmup: int = 0, decay_to: int = 0) -> Callable[[int, dict[str, float]], None]:
    """A learner hook shaping the learning rate: a linear ramp over the first ``warmup`` steps (Adam's first
    updates move every weight by about lr whatever the gradient, which can wreck a tiny policy at once), then,
    with ``decay_to`` > 0, a linear decay reaching 0 at step ``decay_to`` (a tiny policy's greedy answers flip
    from one step to the next; a vanishing step lets the last ones settle)."""
    from torch.optim.lr_scheduler import LambdaLR

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return ramp * (max(0.0, 1.0 - step / decay_to) if decay_to else 1.0)

    schedule = LambdaLR(optimizer, factor)
    return lambda step, metrics: schedule.step()


class ProgressHook:
    """A tqdm bar over learner steps: reward, staleness, trained/generated length, the share of tokens whose importance
    weight was cut, queue depth, last sync time, last accuracy."""

    def __init__(self, steps: int, desc: str = "GRPO", disable: bool = False) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=steps, desc=desc, unit="step", disable=disable, dynamic_ncols=True)
        self.last_acc: float | None = None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        self.last_acc = metrics.get("eval/accuracy", self.last_acc)
        bitten = metrics.get("loss/is_trunc_frac", 0.0) + metrics.get("loss/is_masked_frac", 0.0)
        post = {
            "reward": f"{metrics.get('train/reward_mean', float('nan')):.2f}",
            "stale": f"{metrics.get('rollout/staleness_batch_mean', 0.0):.1f}",
            # trained against generated mean completion length: a gap is length bias
            "len": f"{metrics.get('length/trained_mean', 0.0):.1f}/{metrics.get('length/generated_mean', 0.0):.1f}",
            "is_cut": f"{bitten:.1%}",  # model tokens whose importance weight was capped or masked
            # completion tokens trained so far over those generated (the rest queued, in flight or dropped)
            "kept": f"{metrics.get('tokens/trained', 0) / max(1, metrics.get('tokens/generated', 0)):.0%}",
            "queue": int(metrics.get("queue/depth", 0)),
            "sync": f"{metrics.get('sync/total_s', 0.0) * 1000:.0f}ms",
        }
        if self.last_acc is not None:
            post["held_out"] = f"{self.last_acc:.0%}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


# ----------------------------------------------------------------------------------------------- plotting


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(rows: Sequence[dict[str, Any]], path: Path, before: float | None = None, title: str = "") -> Path:
    """Reward and held-out accuracy, staleness, KL / entropy, and pause / sync times per learner step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    _series(axes[0, 0], rows, {"train/reward_mean": "train reward (mean)"}, smooth=10)
    acc = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if before is not None:
        acc.insert(0, (0, before))
    if acc:
        axes[0, 0].plot(*zip(*acc), "o-", color="C3", label="held-out greedy accuracy")
    axes[0, 0].set_ylim(0, 1.02)
    axes[0, 0].set_title("reward / accuracy")
    _series(axes[0, 1], rows, {"rollout/staleness_batch_mean": "staleness (batch mean)",
                               "rollout/staleness_batch_max": "staleness (batch max)",
                               "queue/depth": "queue depth"})
    axes[0, 1].set_title("staleness (versions) and queue depth (groups)")
    _series(axes[1, 0], rows, {"loss/approx_kl_behaviour": "KL(proximal || behaviour), k3",
                               "loss/kl": "KL to reference, k3", "loss/entropy": "entropy (nats)"})
    axes[1, 0].set_yscale("symlog", linthresh=1e-3)
    axes[1, 0].set_title("KL / entropy")
    _series(axes[1, 1], rows, {"sync/pause_s": "pause", "sync/transfer_s": "transfer",
                               "sync/resume_s": "resume", "sync/total_s": "sync total"}, scale=1000)
    axes[1, 1].set_title("weight sync (ms)")
    for ax in axes[1]:
        ax.set_xlabel("learner step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(ax: Any, rows: Sequence[dict[str, Any]], names: dict[str, str], smooth: int = 1,
            scale: float = 1.0) -> None:
    for key, label in names.items():
        pts = [(r["step"], float(r[key]) * scale) for r in rows if isinstance(r.get(key), (int, float))]
        if not pts:
            continue
        steps, values = zip(*pts)
        ax.plot(steps, values, label=label, alpha=0.35 if smooth > 1 else 0.9)
        if smooth > 1 and len(values) >= smooth:
            window = [sum(values[max(0, i - smooth + 1): i + 1]) / len(values[max(0, i - smooth + 1): i + 1])
                      for i in range(len(values))]
            ax.plot(steps, window, label=f"{label}, {smooth}-step mean")
