"""The learner process for ``asyncrl.examples.embedded_service``: rollouts come in over HTTP, weights go out.

    ASYNCRL_TOKEN=secret python -m asyncrl.examples.remote_learner --model-dir DIR \\
        --port 8100 --service-url http://127.0.0.1:8080 --steps 20

A ``RemoteControlEngine`` reads the version of the engine embedded in the service (waiting for it to start);
the ``VersionClock`` starts there. A ``RolloutIngestServer`` holds the sending end of the rollout queue and
feeds it the groups the service's producer sends; a GRPO ``Learner`` reads the receiving end and publishes
every new version through the standard ``WeightSync`` into the ``RemoteControlEngine``. There are no
producers here, so no ``Pipeline``: just the ingest server and ``learner.run(steps)``.

Shutdown (the learner's side of the handshake in ``asyncrl.queues.ingest_server``): when the steps are done,
or on SIGINT / SIGTERM, ``learner.run`` returns or raises only once its last publication has resumed the
engine (or failed, with an error naming the call). Then the queue is closed, and the ingest server, as it
stops, waits until the service's producer has heard "queue closed"; the producer stops, and the service
closes its engine. Prints one JSON line per event on stdout (``ready``, ``step``, ``done``, ``stopped``), and
nothing else there: anything else written to stdout goes to stderr (``JsonEvents.take_stdout``).
``asyncrl-remote-learner`` runs it too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import asyncrl
from asyncrl import LearnerConfig, QueueConfig, SyncConfig, VersionClock
from asyncrl.queues import RolloutReceiver, create_rollout_queue
from asyncrl.actors.learner import Learner
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.algorithms.losses import GRPOLoss, LossConfig
from asyncrl.engines.embedded import RemoteControlEngine
from asyncrl.examples.common import JsonEvents
from asyncrl.queues.ingest_server import IngestServerConfig, RolloutIngestServer


EVENTS = JsonEvents()  # this program's event stream (stdout, moved aside at start-up: ``main``)


def emit(event: str, **fields: Any) -> None:
    EVENTS.emit(event, **fields)


def build_learner(args: argparse.Namespace, receiver: RolloutReceiver, weight_sync: WeightSync) -> Learner:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    pad_id = AutoTokenizer.from_pretrained(args.model_dir).pad_token_id or 0
    config = LearnerConfig(batch_groups=args.batch_groups, lr=args.lr, sync=weight_sync.config)
    return Learner(model, torch.optim.AdamW(model.parameters(), lr=args.lr), GRPOLoss(LossConfig(), pad_id=pad_id),
                   receiver, weight_sync, config)


async def train(args: argparse.Namespace, receiver: RolloutReceiver, weight_sync: WeightSync,
                ingest: RolloutIngestServer) -> None:
    learner = build_learner(args, receiver, weight_sync)

    def report(step: int, metrics: dict[str, float]) -> None:
        emit("step", step=step, version=learner.version, groups_received=ingest.counters["groups_stored"],
             samples_trained=learner.counters.samples_trained, reward_mean=metrics.get("train/reward_mean"),
             staleness_mean=metrics["rollout/staleness_batch_mean"], sync_s=metrics.get("sync/total_s"),
             prepare_s=metrics.get("sync/prepare_s"))

    learner.hooks.append(report)
    await learner.run(args.steps)  # the last publication has landed (or raised) when this returns
    emit("done", steps=learner.step, version=learner.version, syncs=weight_sync.counters.published,
         groups_received=ingest.counters["groups_stored"], samples_trained=learner.counters.samples_trained)


async def serve(args: argparse.Namespace, token: str) -> None:
    engine = await RemoteControlEngine.connect(args.service_url, token, args.model_dir, ready_timeout_s=args.wait_s)
    try:
        clock = VersionClock(engine.version)
        sender, receiver = create_rollout_queue(
            QueueConfig(capacity=args.queue_capacity, max_staleness=args.max_staleness), clock)
        sync = WeightSync(engine, clock, SyncConfig(every=1, mode="keep", clear_cache=True))
        config = IngestServerConfig(token=token, host=args.host, port=args.port)
        async with RolloutIngestServer(sender, config, queue_metrics=receiver.metrics) as ingest:
            emit("ready", ingest_url=ingest.url)
            try:
                await train(args, receiver, sync, ingest)
            finally:
                receiver.close()  # after the last publication: the producer now hears "queue closed"
        # Leaving ``async with`` waited (up to close_grace_s) for the producer to hear it, then stopped.
    finally:
        await engine.close()  # our HTTP session only; the engine belongs to the service


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "environment: ASYNCRL_TOKEN (required) is the bearer token of this learner's ingest server and of the "
        "service's engine control routes; the service (asyncrl-embedded-service) uses the same one. Events are "
        "JSON lines on stdout; logs go to stderr."))
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    token = os.environ.get("ASYNCRL_TOKEN") or sys.exit("set ASYNCRL_TOKEN (the service uses the same one)")
    EVENTS.take_stdout()  # from here on, anything but an event written to stdout goes to stderr
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncrl.run(serve(args, token))
    except (KeyboardInterrupt, asyncrl.Terminated):  # Ctrl-C or SIGTERM: the run was cancelled and unwound
        pass
    emit("stopped")


if __name__ == "__main__":
    main()
