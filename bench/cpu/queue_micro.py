"""Producer -> rollout queue -> consumer overhead, with an engine that costs nothing.

    python -m bench.cpu.queue_micro             # 200k rollouts, then a cProfile run of 50k
    python -m bench.cpu.queue_micro --quick     # 50k rollouts, profile of 20k

A ``FakeEngine`` (no token delay) answers every request at once with one token (``max_tokens=1``, ``n=1``),
so what is timed is the library's own per-group path: the prompt source, the producer (in-flight slots,
scoring, building ``Sample`` / ``Rollout`` / ``RolloutGroup``), the queue's ``RolloutSender.send`` and
``RolloutReceiver.receive_batch`` (the staleness rule, the group counters). A consumer task takes batches
and discards them (no torch). The reward is a trivial lambda, scored inline on the event loop
(``ProducerConfig(sync_rewards=RewardExecution.INLINE)``): the library's default runs synchronous rewards in
worker threads, and a thread hop per group measures the thread pool, not the queue layer.

Reports ``rollouts_per_s`` (wall) and ``rollouts_per_cpu_s`` (process CPU time; less sensitive to other
load on the machine), and the enqueue-to-dequeue latency ``p50_ms`` / ``p99_ms`` / ``max_ms``: each
producer's end of the queue is wrapped by the benchmark, which records ``time.monotonic()`` per group id as
soon as ``send`` has stored the group (time spent blocked on a full queue is not counted, as before); the
consumer reads it back when ``receive_batch`` hands the group out. Target: >= 50,000 rollouts/s on one core
(the event loop is single-threaded). Then the same loop runs under cProfile and the top functions by own
time are printed and saved.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import logging
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common

TARGET = 50_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rollouts", type=int, help="rollouts timed (default 200k, quick 50k)")
    p.add_argument("--profile-rollouts", type=int, help="rollouts under cProfile (default 50k, quick 20k; 0 = off)")
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--max-inflight", type=int, default=64, help="groups in flight per producer")
    p.add_argument("--capacity", type=int, default=256, help="queue capacity (groups)")
    p.add_argument("--batch", type=int, default=32, help="groups per receive_batch")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (best and median reported)")
    p.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args(argv)
    args.rollouts = args.rollouts or (50_000 if args.quick else 200_000)
    if args.profile_rollouts is None:
        args.profile_rollouts = 20_000 if args.quick else 50_000
    return args


def prompts(count: int) -> Any:
    from asyncrl import Prompt

    for i in range(count):
        yield Prompt(f"p{i}", (1, 2, 3, 4), "1+2=", "3")


class StampedSender:
    """A producer's end of the queue that records when each group was stored (``time.monotonic()``)."""

    __slots__ = ("inner", "stored_at")

    def __init__(self, inner: Any, stored_at: dict[str, float]) -> None:
        self.inner, self.stored_at = inner, stored_at

    async def send(self, group: Any, *, ticket: int | None = None) -> bool:
        stored = await self.inner.send(group, ticket=ticket)
        # ``send`` returns in the same event-loop step that queued the group: the consumer has not run since.
        self.stored_at[group.group_id] = time.monotonic()
        return stored

    async def aclose(self) -> None:
        await self.inner.aclose()


async def one_run(args: argparse.Namespace, count: int) -> dict[str, Any]:
    """Produce ``count`` groups of one 1-token rollout and consume them all. Returns timings."""
    import asyncrl
    from asyncrl.actors import Producer
    from asyncrl.engines.fake import FakeEngine
    from asyncrl.queues import create_rollout_queue

    count -= count % args.batch
    engine = FakeEngine(token_delay_s=0.0)
    sender, receiver = create_rollout_queue(
        asyncrl.QueueConfig(capacity=args.capacity, max_staleness=0), asyncrl.VersionClock(engine.version))
    source = asyncrl.PromptSource(prompts(count))
    cfg = asyncrl.ProducerConfig(sampling=asyncrl.SamplingConfig(n=1, max_tokens=1),
                                 max_inflight_groups=args.max_inflight,
                                 sync_rewards=asyncrl.RewardExecution.INLINE)
    stored_at: dict[str, float] = {}
    with sender:  # each producer holds a clone
        producers = [Producer(engine, source, asyncrl.RewardGroups(lambda p, s: 1.0),
                              StampedSender(sender.clone(), stored_at),
                                      cfg, name=f"producer-{i}")
                     for i in range(args.producers)]
    latencies: list[float] = []

    async def produce(producer: Any) -> None:
        try:
            await producer.run()
        finally:
            await producer.sink.aclose()

    async def consume() -> None:
        for _ in range(count // args.batch):
            batch = await receiver.receive_batch(args.batch)
            now = time.monotonic()
            latencies.extend(now - stored_at.pop(g.group_id) for g in batch)

    c0, t0 = time.process_time(), time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for p in producers:
            tg.create_task(produce(p))
        await tg.create_task(consume())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    receiver.close()
    if len(latencies) != count:
        raise RuntimeError(f"consumed {len(latencies)} of {count}")
    return timings(count, wall, cpu, latencies)


def timings(count: int, wall: float, cpu: float, latencies: list[float]) -> dict[str, Any]:
    latencies.sort()
    return {"rollouts": count, "wall_s": wall, "cpu_s": cpu, "rollouts_per_s": count / wall,
            "rollouts_per_cpu_s": count / cpu if cpu else float("nan"),
            "p50_ms": 1e3 * latencies[len(latencies) // 2], "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
            "max_ms": 1e3 * latencies[-1]}


def profile(args: argparse.Namespace, top: int = 25) -> tuple[str, list[dict[str, Any]]]:
    import asyncrl

    prof = cProfile.Profile()
    prof.enable()
    asyncrl.run(one_run(args, args.profile_rollouts), use_uvloop=not args.no_uvloop)
    prof.disable()
    stats = pstats.Stats(prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in sorted(stats.stats.items(),  # type: ignore[attr-defined]
                                                        key=lambda kv: -kv[1][2])[:top]:
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "calls": nc, "tottime_s": tt,
                     "cumtime_s": ct, "share_of_total": tt / total if total else 0.0,
                     "us_per_rollout": 1e6 * tt / args.profile_rollouts})
    return buf.getvalue(), rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import asyncrl

    result = common.Result("queue_micro", args, argv, module="bench.cpu.queue_micro")
    asyncrl.run(one_run(args, min(args.rollouts, 10_000)), use_uvloop=not args.no_uvloop)  # warm-up
    runs = [asyncrl.run(one_run(args, args.rollouts), use_uvloop=not args.no_uvloop) for _ in range(args.reps)]
    for r in runs:
        print(f"  {r['rollouts']:,} rollouts in {r['wall_s']:.2f}s: {r['rollouts_per_s']:,.0f}/s wall, "
              f"{r['rollouts_per_cpu_s']:,.0f}/s CPU; latency p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms",
              flush=True)
    best = max(runs, key=lambda r: r["rollouts_per_s"])
    med = statistics.median(r["rollouts_per_s"] for r in runs)
    res: dict[str, Any] = {
        "rollouts_per_s": best["rollouts_per_s"], "rollouts_per_s_median": med,
        "rollouts_per_cpu_s": max(r["rollouts_per_cpu_s"] for r in runs),
        "p99_ms": best["p99_ms"], "p50_ms": best["p50_ms"], "target_rollouts_per_s": TARGET,
        "meets_target": best["rollouts_per_s"] >= TARGET, "us_per_rollout_cpu": 1e6 / max(r["rollouts_per_cpu_s"]
                                                                                           for r in runs),
        "runs": runs,
    }
    verdict = "met" if res["meets_target"] else "NOT met"
    print(f"best {res['rollouts_per_s']:,.0f} rollouts/s (median {med:,.0f}; {res['rollouts_per_cpu_s']:,.0f} per "
          f"CPU-second = {res['us_per_rollout_cpu']:.1f} us each), p99 {res['p99_ms']:.2f} ms; target "
          f">= {TARGET:,}/s {verdict}", flush=True)
    if args.profile_rollouts:
        text, rows = profile(args)
        print(f"cProfile, {args.profile_rollouts:,} rollouts, top by own time:\n{text}", flush=True)
        res["profile_top"] = rows
    result.write(res, event_loop="asyncio" if args.no_uvloop else "uvloop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
