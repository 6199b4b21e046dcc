"""Scaling beyond the hardware, simulated: fake engines in Ray actors, many producers, one learner.

    python -m bench.cpu.scaling_sim                    # 64 producers, 1..8 servers, on a local Ray cluster
    python -m bench.cpu.scaling_sim --quick            # fewer steps and repetitions

Every server is a Ray actor holding a ``FakeEngine`` (tokens at ``--token-delay-ms`` each, so a server is
bound by time, not by this machine's cores); rank 0's process runs the real asyncrl pipeline against them:
``--producers`` producers over an ``EnginePool`` of actor-backed engines, the bounded queue, and a ``Learner``
whose backend only sleeps ``--train-ms`` per step and publishes ``--payload-mib`` of weights. A publication
puts the payload into Ray's object store once (``prepare``) and every server fetches it under the pause (the
fan-out a staged directory or a broadcast has in a real run).

Two measurements, for 1, 2, 4 and 8 servers:
- ingest: groups and tokens per second reaching the queue while the learner trains and publishes;
- publication fan-out: ``WeightSync.publish`` alone, repeated ``--reps`` times: prepare, pause, transfer
  (every server fetching the payload), resume, total.

What it shows is the library's side of the scaling (producers, the pool's scheduling, the queue and the
control round trips) and how the fan-out grows with the number of servers on one node's object store; it
does not time real generation or a real NCCL broadcast.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from asyncrl.engines.protocols import Engine
from bench import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--servers", default="1,2,4,8", help="server counts to sweep")
    p.add_argument("--producers", type=int, default=64)
    p.add_argument("--steps", type=int, default=12, help="learner steps per ingest run (quick: 6)")
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--token-delay-ms", type=float, default=5.0, help="per token, per sample, in a server")
    p.add_argument("--train-ms", type=float, default=100.0, help="the fake learner step")
    p.add_argument("--payload-mib", type=float, default=64.0, help="weights published per version")
    p.add_argument("--reps", type=int, default=5, help="publications timed per server count (quick: 3)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the local Ray cluster")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.reps = min(args.steps, 6), min(args.reps, 3)
    return args


class ServerActor:
    """A fake vLLM server: a ``FakeEngine`` in a Ray actor (async methods run on the actor's event loop)."""

    def __init__(self, name: str, token_delay_s: float) -> None:
        from asyncrl.engines.fake import FakeEngine

        self.engine = FakeEngine(token_delay_s=token_delay_s, name=name, max_model_len=4096)
        self.received = 0  # bytes fetched by publications

    async def generate(self, prompt_ids: tuple[int, ...], params: Any, request_id: str, n: int | None) -> Any:
        return await self.engine.generate(prompt_ids, params, request_id, n)

    async def pause(self, mode: Any, clear_cache: bool) -> None:
        await self.engine.pause(mode, clear_cache)

    async def resume(self) -> None:
        await self.engine.resume()

    async def load(self, version: int, refs: list[Any]) -> int:
        payload = await refs[0]  # the fetch from the object store is the transfer being measured
        size = sum(t.numel() * t.element_size() for t in payload.values())
        self.received += size
        self.engine._version = version  # noqa: SLF001 (the fake's load without keeping the tensors)
        return size


class ActorEngine(Engine):
    """The three engine roles over one ``ServerActor``, as a pool member."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return 4096

    @property
    def vocab_size(self) -> int:
        return 100  # the FakeEngine in each actor (its default vocabulary)

    async def generate(self, prompt_ids: tuple[int, ...], params: Any, request_id: str, n: int | None = None) -> Any:
        return await self.actor.generate.remote(prompt_ids, params, request_id, n)

    async def prepare(self, update: Any) -> Any:
        import ray

        if isinstance(update.staged, list):  # staged by the first pool member: adopt
            return update
        return replace(update, staged=[ray.put(dict(update.tensors))])  # put once, for every server

    async def pause(self, mode: Any, clear_cache: bool) -> None:
        await self.actor.pause.remote(mode, clear_cache)

    async def load(self, update: Any) -> None:
        await self.actor.load.remote(update.version, update.staged)
        self._version = update.version

    async def resume(self) -> None:
        await self.actor.resume.remote()

    def release(self, update: Any) -> None:
        pass  # the object store frees the payload once no reference is left

    async def check_alive(self) -> None:
        pass

    async def close(self) -> None:
        pass


class SimBackend:
    """A ``TrainingBackend`` that sleeps instead of training and publishes a fixed payload."""

    def __init__(self, train_s: float, payload_mib: float) -> None:
        import torch

        class _Loss:
            min_group_size = 2

        self.model, self.optimizer, self.loss = None, None, _Loss()
        self.train_s = train_s
        self.payload = {"w": torch.zeros(int(payload_mib * 2**20 / 4), dtype=torch.float32)}

    def train_step(self, batch: Sequence[Any], step: int) -> dict[str, float]:
        time.sleep(self.train_s)
        return {"loss/total": 0.0}

    def publication_state(self) -> Mapping[str, Any]:
        return self.payload

    def snapshot(self) -> Mapping[str, Any]:
        return self.payload

    def release(self, tensors: Mapping[str, Any]) -> None:
        pass

    def trim(self) -> None:
        pass


def start_servers(count: int, token_delay_s: float) -> list[ActorEngine]:
    import ray

    cls = ray.remote(num_cpus=0)(ServerActor)  # time-bound fakes: placement is not what is measured here
    actors = [cls.options(max_concurrency=10_000).remote(f"server-{i}", token_delay_s) for i in range(count)]
    return [ActorEngine(a, f"server-{i}") for i, a in enumerate(actors)]


def prompts() -> Any:
    from asyncrl import Prompt

    i = 0
    while True:
        yield Prompt(f"p{i}", (1, 2 + i % 50, 3, 4))
        i += 1


async def ingest(args: argparse.Namespace, engines: list[ActorEngine]) -> dict[str, Any]:
    """The whole pipeline for ``args.steps`` steps: what reaches the queue, per second."""
    from asyncrl import PipelineConfig, ProducerConfig, QueueConfig, SamplingConfig
    from asyncrl.config import LearnerConfig, RewardExecution
    from asyncrl.distributed.run import sharded_pipeline
    from asyncrl.groups import RewardGroups
    from asyncrl.engines.pool import EnginePool

    sampling = SamplingConfig(n=args.group_size, max_tokens=args.max_tokens)
    config = PipelineConfig(
        progress=False,  # a benchmark's output stays its own
        producer=ProducerConfig(sampling=sampling, max_inflight_groups=2, sync_rewards=RewardExecution.INLINE),
        queue=QueueConfig(capacity=args.batch_groups * 2, max_staleness=1),
        learner=LearnerConfig(batch_groups=args.batch_groups), num_producers=args.producers)
    pool = EnginePool(engines)
    backend = SimBackend(args.train_ms / 1000, args.payload_mib)
    reward = lambda p, s: float(len(s.token_ids) % 2)  # noqa: E731
    pipe = sharded_pipeline(pool, backend, prompts(), RewardGroups(reward), config,  # type: ignore[arg-type]
                            close_engine=False)
    result = await pipe.run(args.steps)
    entered = pipe.receiver.counters.entered
    return {"servers": len(engines), "producers": args.producers, "wall_s": result.wall_s,
            "groups_queued": entered, "groups_per_s": entered / result.wall_s,
            "groups_trained_per_s": result.groups_trained / result.wall_s,
            "tokens_per_s": result.tokens_generated / result.wall_s, "train_s": result.train_s,
            "sync_s": result.sync_s, "paused_frac": result.sync_s / result.wall_s, "dropped": result.dropped}


async def fan_out(args: argparse.Namespace, engines: list[ActorEngine]) -> dict[str, Any]:
    """``WeightSync.publish`` of the payload to every server, ``args.reps`` times (after one warm-up)."""
    from asyncrl.actors.weight_sync import WeightSync
    from asyncrl.config import SyncConfig
    from asyncrl.engines.pool import EnginePool
    from asyncrl.versions import VersionClock

    pool = EnginePool(engines)
    sync = WeightSync(pool, VersionClock(pool.version), SyncConfig())
    payload = SimBackend(0, args.payload_mib).payload
    await sync.publish(payload)
    timings = [await sync.publish(payload) for _ in range(args.reps)]

    def median(field: str) -> float:
        return statistics.median(getattr(t, field) for t in timings)

    return {"servers": len(engines), "payload_mib": args.payload_mib, "reps": args.reps,
            **{f"{f}_median": median(f) for f in ("prepare_s", "pause_s", "transfer_s", "resume_s", "total_s")}}


async def sweep(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {"ingest": [], "fan_out": []}
    for count in (int(s) for s in args.servers.split(",")):
        engines = start_servers(count, args.token_delay_ms / 1000)
        out["fan_out"].append(await fan_out(args, engines))
        out["ingest"].append(await ingest(args, engines))
        print(f"{count} servers: ingest {out['ingest'][-1]['groups_per_s']:.1f} groups/s, publication "
              f"{out['fan_out'][-1]['total_s_median'] * 1000:.0f} ms paused", flush=True)
        import ray

        for e in engines:
            ray.kill(e.actor)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.set_env()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # one node, on the loopback address
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    result = common.Result("scaling_sim", args, module="bench.cpu.scaling_sim")
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="WARNING")
    try:
        out = asyncio.run(sweep(args))
    finally:
        ray.shutdown()
    out["notes"] = ("fake engines in Ray actors on one node; ingest = groups entering the queue per wall second "
                    "with a sleeping learner; fan-out = WeightSync.publish to every server through Ray's "
                    "object store (put once, fetched by each server under the pause)")
    result.write(out)


if __name__ == "__main__":
    main()
