"""Ray as the launcher (``pip install 'asyncrl[ray]'``): a placement group places the vLLM servers and the learner
ranks, their addresses are wired together, and every rank runs the same program as under torchrun.

    python -m asyncrl.launch.ray --address auto --entry asyncrl.examples.distributed_grpo --model-dir DIR --servers 2 \\
        --ranks 2 --server-gpus 1 --rank-gpus 1 -- --steps 50 --transfer nccl   # an existing cluster (`ray start`)
    python -m asyncrl.launch.ray --local-cpus 2 --entry asyncrl.examples.distributed_grpo --model-dir DIR --servers 1 \\
        --ranks 2 -- --steps 3

One actor per server starts ``vllm.entrypoints.openai.api_server`` on its node (``start_vllm_server``) and
reports its URL; one actor per rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` (a free port on rank 0's node) and ``ASYNCRL_SERVERS``, then calls ``main(argv)`` of the entry
module (``--entry``, required) with ``--model-dir`` and the arguments after ``--``. The ranks import the entry
module as this process would: installed, or found through the PYTHONPATH the Ray workers inherit. Rank 0
runs the pipeline; the others serve. The launcher waits for every rank: the first failure (an error, or an
actor that died) stops the other ranks and the servers and is raised naming the rank. Servers are always
stopped, and the placement group removed, before the launcher returns.

``--local-cpus N`` starts a single-node cluster in this process, on the loopback address.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.errors import ConfigError
from asyncrl.launch.layout import Layout

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A rank or a server failed; the message names which one."""


def _reachable_host() -> tuple[str, str]:
    """(address others use to reach this node, address a server binds to)."""
    import ray

    ip = ray.util.get_node_ip_address()
    return (ip, "127.0.0.1") if ip.startswith("127.") else (ip, "0.0.0.0")


class ServerActor:
    """Runs one vLLM server on its node for as long as the actor lives (until ``stop``)."""

    def __init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()

    async def start(self, model_dir: str, extra_args: list[str], env: dict[str, str]) -> str:
        from asyncrl.engines.vllm_remote.process import free_port, start_vllm_server

        ip, bind = _reachable_host()
        port = free_port()
        args = [*extra_args, "--host", bind]  # later flags win: the bind address is ours to choose
        server = await self._stack.enter_async_context(start_vllm_server(model_dir, port, extra_args=args, env=env))
        log.info("server pid %d on %s:%d", server.pgid, ip, port)
        return f"http://{ip}:{port}"

    async def stop(self) -> None:
        await self._stack.aclose()


class RankActor:
    """One learner rank: the process-group environment, then the entry module's ``main(argv)``."""

    def address(self) -> tuple[str, int]:
        from asyncrl.engines.vllm_remote.process import free_port

        return _reachable_host()[0], free_port()

    def run(self, entry: str, argv: list[str], env: dict[str, str]) -> Any:
        os.environ.update(env)
        main = getattr(importlib.import_module(entry), "main", None)
        if not callable(main):
            raise ConfigError("entry", f"module {entry!r} has no main(argv)")
        return main(argv)


def launch(layout: Layout, model_dir: str | Path, argv: Sequence[str] = (), *, entry: str,
           server_args: Sequence[str] = (), server_env: dict[str, str] | None = None,
           timeout_s: float = 3600.0) -> Any:
    """Place and run (``ray.init`` first): every rank runs ``main(argv)`` of the module named ``entry`` (e.g.
    ``"asyncrl.examples.distributed_grpo"``). Returns rank 0's result; raises ``LaunchError`` on a failure."""
    check_entry(entry)
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    model_dir = str(Path(model_dir).resolve())
    pg = placement_group(layout.bundles(), strategy=layout.strategy.value)
    try:
        ray.get(pg.ready(), timeout=min(timeout_s, 600.0))
        servers = [_actor(ServerActor, pg, layout.server_bundle(i), layout.server_cpus, layout.server_gpus)
                   for i in range(layout.servers)]
        try:
            urls = ray.get([s.start.remote(model_dir, list(server_args), dict(server_env or {})) for s in servers],
                           timeout=timeout_s)
            log.info("servers up: %s", urls)
            return _run_ranks(layout, pg, entry, ["--model-dir", model_dir, *argv], urls, timeout_s)
        finally:
            _stop_servers(servers)
    finally:
        remove_placement_group(pg)


def _actor(cls: type, pg: Any, bundle: int, cpus: float, gpus: int) -> Any:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return ray.remote(cls).options(
        num_cpus=cpus, num_gpus=gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
    ).remote()


def _run_ranks(layout: Layout, pg: Any, entry: str, argv: list[str], urls: list[str], timeout_s: float) -> Any:
    import ray

    ranks = [_actor(RankActor, pg, layout.rank_bundle(r), layout.rank_cpus, layout.rank_gpus)
             for r in range(layout.ranks)]
    try:
        master, port = ray.get(ranks[0].address.remote(), timeout=120)
        common = {"WORLD_SIZE": str(layout.ranks), "MASTER_ADDR": master, "MASTER_PORT": str(port),
                  "ASYNCRL_SERVERS": ",".join(urls)}
        # Ray shows each rank only its own GPU: it is device 0 in that process.
        refs = {ranks[r].run.remote(entry, argv, {**common, "RANK": str(r), "LOCAL_RANK": "0"}): r
                for r in range(layout.ranks)}
        return _wait_all(refs, timeout_s)
    finally:
        for actor in ranks:
            ray.kill(actor)


def _wait_all(refs: dict[Any, int], timeout_s: float) -> Any:
    """Every rank's result, rank 0's returned; the first failure raised at once, naming its rank."""
    import ray

    results: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not done:
            raise LaunchError(f"ranks {sorted(refs[p] for p in pending)} still running after {timeout_s:.0f}s")
        ref = done[0]
        try:
            results[refs[ref]] = ray.get(ref)
        except (ray.exceptions.RayError, Exception) as exc:
            raise LaunchError(f"learner rank {refs[ref]} failed: {_first_line(exc)}") from exc
    return results.get(0)


def _stop_servers(servers: list[Any]) -> None:
    import ray

    stops = [s.stop.remote() for s in servers]
    for server, ref in zip(servers, stops, strict=True):
        try:
            ray.get(ref, timeout=60)
        except Exception as exc:  # a dead actor's server died with its process group
            log.warning("stopping a server failed: %s", _first_line(exc))
        ray.kill(server)


def check_entry(entry: str) -> None:
    """``entry`` must name a module (dotted identifiers); whether it imports is found out where the ranks run."""
    if not isinstance(entry, str) or not all(part.isidentifier() for part in entry.split(".")):
        raise ConfigError("entry", f"{entry!r} is not a module name (such as 'asyncrl.examples.distributed_grpo')")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors[-1] if errors else lines[0] if lines else repr(exc))[:1000]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address", help="an existing Ray cluster ('auto': the one this node belongs to)")
    where.add_argument("--local-cpus", type=int, help="start a one-node cluster here with this many CPUs")
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--server-gpus", type=int, default=0)
    p.add_argument("--rank-gpus", type=int, default=0)
    p.add_argument("--server-cpus", type=float, default=1.0)
    p.add_argument("--rank-cpus", type=float, default=1.0)
    p.add_argument("--strategy", default="PACK")
    p.add_argument("--server-args", default="", help="extra vLLM server flags, one string")
    p.add_argument("--entry", required=True, help="module whose main(argv) every rank runs, e.g. "
                   "asyncrl.examples.distributed_grpo (importable where the ranks run)")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    return p.parse_args(own), rest


def main(argv: list[str] | None = None) -> Any:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args, rest = parse_args(argv)
    layout = Layout(servers=args.servers, ranks=args.ranks, server_gpus=args.server_gpus,
                    rank_gpus=args.rank_gpus, server_cpus=args.server_cpus, rank_cpus=args.rank_cpus,
                    strategy=args.strategy)
    if args.local_cpus:  # one node: keep Ray's own traffic on the loopback address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if args.local_cpus:
        ray.init(num_cpus=args.local_cpus, num_gpus=0 if not layout.total_gpus else None,
                 include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=args.address or "auto", logging_level=logging.WARNING)
    try:
        result = launch(layout, args.model_dir, rest, entry=args.entry, server_args=args.server_args.split(),
                        timeout_s=args.timeout_s)
    finally:
        ray.shutdown()
    print(json.dumps({"event": "launched", "result": result}, default=str), flush=True)
    return result


if __name__ == "__main__":
    main()
