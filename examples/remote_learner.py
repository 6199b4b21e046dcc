"""The learner process for ``examples/embedded_service.py``: rollouts come in over HTTP, weights go out.

    ASYNCRL_TOKEN=secret python examples/remote_learner.py --model-dir DIR \\
        --port 8100 --service-url http://127.0.0.1:8080 --steps 20

A ``RolloutIngestServer`` feeds a ``RolloutQueue`` with the groups the service's producer ships; a GRPO
``Learner`` trains on them and publishes every new version through the standard ``WeightSync`` into a
``RemoteControlEngine``, i.e. into the engine embedded in the service. There are no producers here, so no
``Pipeline``: just the ingest server and ``learner.run(steps)``.

Prints one JSON line per event on stdout (``ready``, ``step``, ``done``). SIGINT / SIGTERM stop it cleanly:
the queue is closed (the service's producer sees that and stops) and the ingest server shut down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import asyncrl  # noqa: E402
from asyncrl import LearnerConfig, QueueConfig, RolloutQueue, SyncConfig  # noqa: E402
from asyncrl.actors.learner import Learner  # noqa: E402
from asyncrl.actors.weight_sync import WeightSync  # noqa: E402
from asyncrl.algorithms.losses import GRPOLoss, LossConfig  # noqa: E402
from asyncrl.engines.control import RemoteControlEngine  # noqa: E402
from asyncrl.queues.remote import IngestServerConfig, RolloutIngestServer  # noqa: E402


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def build_learner(args: argparse.Namespace, queue: RolloutQueue, engine: RemoteControlEngine) -> Learner:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    pad_id = AutoTokenizer.from_pretrained(args.model_dir).pad_token_id or 0
    config = LearnerConfig(batch_groups=args.batch_groups, lr=args.lr,
                           sync=SyncConfig(every=1, mode="keep", clear_cache=True))
    return Learner(model, torch.optim.AdamW(model.parameters(), lr=args.lr), GRPOLoss(LossConfig(), pad_id=pad_id),
                   queue, WeightSync(engine, config.sync), config, version=engine.version)


async def main(args: argparse.Namespace, token: str) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    queue = RolloutQueue(QueueConfig(capacity=args.queue_capacity, max_staleness=args.max_staleness))
    async with RolloutIngestServer(queue, IngestServerConfig(token=token, host=args.host, port=args.port)) as ingest:
        emit("ready", ingest_url=ingest.url)
        engine = await RemoteControlEngine.connect(args.service_url, token, args.model_dir,
                                                   ready_timeout_s=args.wait_s)
        try:
            learner = build_learner(args, queue, engine)

            def report(step: int, metrics: dict[str, float]) -> None:
                emit("step", step=step, version=learner.version, groups_received=ingest.counts["groups_stored"],
                     samples_trained=learner.samples_trained, reward_mean=metrics.get("train/reward_mean"),
                     staleness_mean=metrics["rollout/staleness_batch_mean"], sync_s=metrics.get("sync/total_s"),
                     prepare_s=metrics.get("sync/prepare_s"))

            learner.hooks.append(report)
            await learner.run(args.steps)
            emit("done", steps=learner.step, version=learner.version, syncs=learner.weight_sync.count,
                 groups_received=ingest.counts["groups_stored"], samples_trained=learner.samples_trained)
        finally:
            await queue.close()  # in-flight and later posts get "queue closed": the producer stops
            await engine.close()  # our HTTP session only; the engine belongs to the service


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="the same model the service's engine started from")
    p.add_argument("--service-url", required=True, help="the service hosting the engine control routes")
    p.add_argument("--host", default="127.0.0.1", help="ingest server interface")
    p.add_argument("--port", type=int, default=8100, help="ingest server port (0 = ephemeral)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-groups", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--queue-capacity", type=int, default=4)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for the service's engine")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    token = os.environ.get("ASYNCRL_TOKEN") or sys.exit("set ASYNCRL_TOKEN (the service uses the same one)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncrl.run(main(args, token))
    except (KeyboardInterrupt, asyncio.CancelledError):
        emit("stopped")
