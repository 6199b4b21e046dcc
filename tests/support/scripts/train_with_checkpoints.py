"""Train a tiny model with the real Pipeline/Learner/Checkpointer on a FakeEngine, checkpointing every step.

Used by tests/checkpoint/test_checkpoint_resume.py, which kills it with SIGKILL and runs it again with ``--resume``.
Prints one JSON object per line on stdout (flushed):

* ``{"event": "handout", "index": i, "id": prompt_id}`` for every prompt the source hands out;
* ``{"event": "step", "step": n, "version": v, "trained": [index...], "digest": sha256 of the weights}``;
* ``{"event": "saved", "step": n}`` once checkpoint n is complete on disk;
* ``{"event": "resumed", "step": n, "version": v, "cursor": c, "digest": ..., "engine_version": v}``;
* ``{"event": "write-paused", "step": n, "tmp": dir}`` with ``--pause-write-at n``: the writer stops after
  the first file of that checkpoint and waits (forever, in practice) on a FIFO named ``release`` in --dir;
* ``{"event": "done", "steps": n, "unaccounted": u}`` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import sys
import threading

import torch

from asyncrl import (
    LearnerConfig, PipelineConfig, ProducerConfig, Prompt, QueueConfig, RewardExecution, SamplingConfig,
)
from asyncrl.algorithms.losses import Loss, LossOutput
from asyncrl.checkpoint import CheckpointConfig, Checkpointer, latest, resume_pipeline
from asyncrl.engines.fake import FakeEngine
from asyncrl.groups import RewardGroups

_print_lock = threading.Lock()


def emit(**row: object) -> None:
    with _print_lock:
        print(json.dumps(row), flush=True)


def make_items(count: int = 50_000, seed: int = 7) -> list[Prompt]:
    """A fixed, shuffled data order: index i of the stream is always the same prompt."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return [Prompt(f"q{k}", (1 + k % 31, 2 + k % 17, 3 + k % 5, 4), answer=k) for k in order]


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class RegressionLoss(Loss):
    """Predict each rollout's reward from its prompt tokens; a little noise makes the weights depend on the
    torch RNG (so restoring it matters). Records the groups of the current step."""

    min_group_size = 1

    def __init__(self) -> None:
        self.trained: list[int] = []

    def compute(self, model, groups, **kw):
        rows = [(g.prompt, r) for g in groups for r in g.rollouts]
        x = torch.tensor([[float(t) for t in p.token_ids[:4]] for p, _ in rows]) / 10
        y = torch.tensor([r.reward for _, r in rows])
        pred = model(x).squeeze(-1) + torch.randn(len(rows)) * 0.01
        loss = ((pred - y) ** 2).mean()
        self.trained.extend(int(g.group_id.rsplit("#", 1)[1]) for g in groups)
        return LossOutput(loss=loss, metrics={"loss/policy": float(loss.detach())},
                          num_tokens=sum(g.num_tokens for g in groups))


def handed_out(items: list[Prompt], start: int):
    """The stream, logging each prompt as the PromptSource pulls it (skipped ones, before ``start``, are not
    handed out)."""
    for index, prompt in enumerate(items):
        if index >= start:
            emit(event="handout", index=index, id=prompt.prompt_id)
        yield prompt


class ScriptCheckpointer(Checkpointer):
    def __init__(self, config: CheckpointConfig, pause_at: int | None) -> None:
        super().__init__(config)
        self.pause_at = pause_at

    def _write(self, snapshot):
        checkpoint = super()._write(snapshot)
        emit(event="saved", step=checkpoint.step)
        return checkpoint

    def _write_file(self, path, write):
        result = super()._write_file(path, write)
        if self.pause_at is not None and path.parent.name.startswith(f".tmp-step-{self.pause_at:06d}-"):
            fifo = self.dir / "release"
            os.mkfifo(fifo)
            emit(event="write-paused", step=self.pause_at, tmp=str(path.parent))
            with open(fifo) as f:  # blocks until a writer opens the FIFO (the test kills us instead)
                f.read()
        return result


def config() -> PipelineConfig:
    return PipelineConfig(
        # The reward is a modulo: inline, so the order groups finish in (and are trained in) is deterministic.
        producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=3), max_inflight_groups=4,
                                sync_rewards=RewardExecution.INLINE),
        queue=QueueConfig(capacity=8, max_staleness=1_000_000),
        learner=LearnerConfig(batch_groups=2, lr=1e-2),
    )


def reward(prompt, sample) -> float:
    return (prompt.answer % 7) / 7


async def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    random.seed(0)
    ckpt_cfg = CheckpointConfig(dir=args.dir, every_steps=1, keep=args.keep)
    model = torch.nn.Linear(4, 1)
    loss = RegressionLoss()
    engine = FakeEngine()
    checkpoint = latest(args.dir) if args.resume else None
    if args.resume and checkpoint is None:
        raise SystemExit(f"--resume: no complete checkpoint in {args.dir}")
    start = checkpoint.meta["cursor"] if checkpoint else 0
    async with ScriptCheckpointer(ckpt_cfg, args.pause_write_at) as ckpt:
        pipe, state = await resume_pipeline(engine, model, handed_out(make_items(), start), RewardGroups(reward),
                                            config(),
                                            checkpoint=checkpoint, checkpointer=ckpt, loss=loss)
        if state is not None:
            emit(event="resumed", step=state.step, version=pipe.learner.version, cursor=state.cursor,
                 digest=digest(model.state_dict()), engine_version=engine.version,
                 engine_digest=digest(dict(engine.weights)))

        def on_step(step: int, metrics: dict[str, float]) -> None:
            emit(event="step", step=step, version=pipe.learner.version, trained=loss.trained,
                 digest=digest(model.state_dict()))
            loss.trained = []

        pipe.learner.hooks.insert(0, on_step)  # before the checkpoint hook: "step n" precedes "saved n"
        stats = await pipe.run(args.steps)
    emit(event="done", steps=stats.steps, unaccounted=stats.unaccounted, trained=stats.groups_trained)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True, help="stop when the learner reaches this step")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--pause-write-at", type=int, default=None)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(parser.parse_args()))
