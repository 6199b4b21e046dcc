"""Agents through the OpenAI-compatible endpoint: does the example learn, what does the endpoint cost, and what
does session-sticky routing buy?

    python -m bench.cpu.openai_agent                                  # all three parts (~25 min on 2 cores)
    python -m bench.cpu.openai_agent --parts latency routing          # the serving parts alone
    python -m bench.cpu.openai_agent --seeds 0 --steps 10 --warm-steps 200 --held-out 50 --parts learning  # smoke

Parts, each a section of ``openai_agent_<device>.json`` (common header: ``bench/common.py``; each section also
records its own run, and a run of some parts keeps the sections of the others):

- ``learning``: ``asyncrl/examples/openai_agent.py`` end to end per seed (its own model, warm start, engine):
  held-out greedy accuracy and tool-call rate before and after GRPO, per seed and mean / min / max.
- ``latency``: one vLLM OpenAI server; the same chat requests (``--requests`` of ``--max-tokens`` tokens, at
  ``--concurrency`` in flight) sent to the server's own ``/v1/chat/completions``, to asyncrl's endpoint in
  front of it (a ``RemoteVLLMEngine``), and, to tell the two layers apart, straight to that ``RemoteVLLMEngine``
  on the ids the endpoint renders; in alternating rounds; p50 and p99 per side, and their ratios.
- ``routing``: two servers behind an ``EnginePool``, multi-turn sessions through the endpoint (a long shared
  system message, ``--turns`` calls each), sticky (``EnginePool.for_session``) and not (every call least-loaded),
  in alternating rounds: the servers' prefix-cache hit rate (their ``/metrics``) and the calls' latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common

# A chat template over the tiny arithmetic tokenizer's characters (digits, '+', '='): what both servers render.
TEMPLATE = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{ m.content }}{{ eos_token }}"
            "{%- else -%}<s>{{ m.content }}{%- endif -%}{%- endfor -%}")
SYSTEM = "".join(f"{i}+{i + 1}=" for i in range(10, 40))  # ~150 tokens every call of a session shares


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--parts", nargs="+", choices=("learning", "latency", "routing"),
                   default=["learning", "latency", "routing"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warm-steps", type=int, default=800)
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--requests", type=int, default=200, help="latency: requests per side per round")
    p.add_argument("--rounds", type=int, default=3, help="latency and routing: alternating rounds per side")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--sessions", type=int, default=16, help="routing: sessions per round")
    p.add_argument("--turns", type=int, default=4, help="routing: calls per session")
    p.add_argument("--tight-kv-blocks", type=int, nargs="*", default=[64, 24], help=(
        "routing: KV blocks (32 tokens) per server in the tight runs: 64 holds every session's context on one "
        "server, 24 not even the sessions pinned there"))
    p.add_argument("--load-gen", help=argparse.SUPPRESS)  # internal: the latency part's client process
    return p.parse_args(argv)


# -- learning ---------------------------------------------------------------------------------------------------


def learning(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for seed in args.seeds:
        out = common.CACHE / "openai_agent" / f"seed{seed}"
        s = common.run_example(f"seed {seed}", "asyncrl.examples.openai_agent", out, [
            "--seed", str(seed), "--steps", str(args.steps), "--warm-steps", str(args.warm_steps),
            "--held-out", str(args.held_out), "--eval-every", "0"])
        runs.append({"seed": seed, "rl_wall_s": s["wall_s"], "steps": s["steps"],
                     "accuracy_before": s["before"]["accuracy"], "accuracy_after": s["after"]["accuracy"],
                     "tool_rate_before": s["before"]["tool_rate"], "tool_rate_after": s["after"]["tool_rate"],
                     "calls_per_episode": s["agent"]["agent/calls_per_episode"], "splits": s["agent"]["agent/splits"],
                     "dropped": s["dropped"]})
        r = runs[-1]
        print(f"seed {seed}: accuracy {r['accuracy_before']:.1%} -> {r['accuracy_after']:.1%}, tool-call rate "
              f"{r['tool_rate_before']:.1%} -> {r['tool_rate_after']:.1%}", flush=True)
    summary = {k: _spread([r[k] for r in runs]) for k in
               ("accuracy_before", "accuracy_after", "tool_rate_before", "tool_rate_after", "rl_wall_s")}
    summary["gain_points"] = _spread([100 * (r["accuracy_after"] - r["accuracy_before"]) for r in runs])
    return {"summary": summary, "runs": runs}


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


# -- serving ----------------------------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _timed_calls(send: Any, n: int, concurrency: int) -> list[float]:
    limit, out = asyncio.Semaphore(concurrency), []

    async def one(i: int) -> None:
        async with limit:
            t0 = time.perf_counter()
            await send(i)
            out.append(time.perf_counter() - t0)
    await asyncio.gather(*(one(i) for i in range(n)))
    return out


@contextlib.asynccontextmanager
async def _servers(model_dir: Path, count: int, template: Path, kv_blocks: int | None = None) -> Any:
    """``count`` servers (``kv_blocks``: each one's KV cache in 32-token blocks; None: vLLM's own size)."""
    from asyncrl.engines.vllm_remote import RemoteEngineConfig, RemoteVLLMEngine, free_port, start_vllm_server

    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--block-size", "32",
            "--enable-prefix-caching", "--chat-template", str(template)]
    if kv_blocks is not None:
        args += ["--num-gpu-blocks-override", str(kv_blocks)]
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(start_vllm_server(model_dir, free_port(), extra_args=args))
                   for _ in range(count)]
        engines = [await RemoteVLLMEngine.connect(RemoteEngineConfig(
            base_url=s.base_url, model=s.model_name, model_dir=str(model_dir)), name=f"server{i}")
            for i, s in enumerate(servers)]
        try:
            yield servers, engines
        finally:
            for e in engines:
                await e.close()


async def latency(args: argparse.Namespace, model_dir: Path, template: Path) -> dict[str, Any]:
    """The clients of both HTTP sides run in a load-generating process of their own, as agents would: what is
    timed in this one is only the endpoint (and, for ``engine``, asyncrl's server client)."""
    from transformers import AutoTokenizer

    from asyncrl.agents import AgentEndpoint, ChatRenderer, EndpointConfig
    from asyncrl.config import SamplingConfig

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = ChatRenderer(tok, TEMPLATE)
    sides = ("vllm", "engine", "asyncrl")
    times: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[int]] = {k: [] for k in sides}
    async with _servers(model_dir, 1, template) as (servers, engines):
        async with AgentEndpoint(engines[0], renderer, EndpointConfig(token="bench")) as ep:
            target = {"vllm": (f"{servers[0].base_url}/v1", "x", servers[0].model_name),
                      "asyncrl": (ep.base_url, "bench", "asyncrl-policy")}

            async def direct(i: int) -> None:  # asyncrl's engine client alone, on the ids the endpoint renders
                prompt = renderer.prompt_ids([{"role": "user", "content": _question(i)}], None)
                [s] = await engines[0].generate(prompt, SamplingConfig(n=1, max_tokens=args.max_tokens, seed=i),
                                                f"direct-{i}")
                tokens["engine"].append(len(s.token_ids))

            async def run(side: str, n: int) -> list[float]:
                if side == "engine":
                    return await _timed_calls(direct, n, args.concurrency)
                url, key, model = target[side]
                spec = json.dumps({"url": url, "key": key, "model": model, "n": n, "concurrency": args.concurrency,
                                   "max_tokens": args.max_tokens})
                proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.cpu.openai_agent",
                                                            "--load-gen", spec, stdout=asyncio.subprocess.PIPE,
                                                            cwd=common.ROOT)
                out, _ = await proc.communicate()
                if proc.returncode != 0:
                    raise RuntimeError(f"the load generator for {side} exited with {proc.returncode}")
                seen = json.loads(out.decode().strip().splitlines()[-1])
                tokens[side] += seen["tokens"]
                return seen["seconds"]
            for side in sides:  # warm-up: connections and the template compiled on every side
                await run(side, 16)
                tokens[side].clear()
            for _ in range(args.rounds):
                for side in sides:
                    times[side] += await run(side, args.requests)
    out: dict[str, Any] = {}
    for side, values in times.items():
        out[side] = {"p50_ms": 1000 * _pct(values, 0.5), "p99_ms": 1000 * _pct(values, 0.99),
                     "requests": len(values), "completion_tokens_mean": statistics.fmean(tokens[side])}
    out["engine_ratio_p50"] = out["engine"]["p50_ms"] / out["vllm"]["p50_ms"]  # the engine client's share
    out["ratio_p50"] = out["asyncrl"]["p50_ms"] / out["vllm"]["p50_ms"]
    out["ratio_p99"] = out["asyncrl"]["p99_ms"] / out["vllm"]["p99_ms"]
    out["overhead_p50_ms"] = out["asyncrl"]["p50_ms"] - out["vllm"]["p50_ms"]
    out["concurrency"], out["max_tokens"] = args.concurrency, args.max_tokens
    return out


def _question(i: int) -> str:
    return f"{i % 90 + 10}+{i % 7}="


async def _load_gen(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["n"]`` chat calls at ``spec["concurrency"]``: each one's seconds and completion tokens."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=spec["url"], api_key=spec["key"], max_retries=0)
    tokens: list[int] = []

    async def send(i: int) -> None:
        r = await client.chat.completions.create(model=spec["model"], messages=[{"role": "user",
                                                                                 "content": _question(i)}],
                                                 max_tokens=spec["max_tokens"], temperature=1.0, seed=i)
        tokens.append(r.usage.completion_tokens)
    seconds = await _timed_calls(send, spec["n"], spec["concurrency"])
    await client.close()
    return {"seconds": seconds, "tokens": tokens}


def _session_system(key: int) -> str:
    """~150 tokens of digits of this session alone: only its own earlier calls can have cached them."""
    import random

    rng = random.Random(key)
    return "".join(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=" for _ in range(25))


async def _cache_counts(servers: list[Any]) -> tuple[float, float]:
    """(hits, queries) of the servers' prefix caches, in tokens, summed (``/metrics``)."""
    import aiohttp

    hits = queries = 0.0
    async with aiohttp.ClientSession() as http:
        for s in servers:
            async with http.get(f"{s.base_url}/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("vllm:prefix_cache_hits_total"):
                        hits += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:prefix_cache_queries_total"):
                        queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def _roaming(pool: Any) -> Any:
    """The pool with stickiness off: every session's call goes to the least-loaded member."""
    from asyncrl.engines.protocols import Sampler

    class Roaming(Sampler):
        name = "roaming"
        version = property(lambda self: pool.version)
        max_model_len = property(lambda self: pool.max_model_len)
        vocab_size = property(lambda self: pool.vocab_size)

        async def generate(self, *a: Any, **kw: Any) -> Any:
            return await pool.generate(*a, **kw)
    return Roaming()


async def routing(args: argparse.Namespace, model_dir: Path, template: Path) -> dict[str, Any]:
    """Both sides with room for every session's context on each server, then with each ``--tight-kv-blocks``."""
    out = {"roomy": await _routing(args, model_dir, template, None)}
    for blocks in args.tight_kv_blocks:
        out[f"kv{blocks}"] = await _routing(args, model_dir, template, blocks)
    return out


async def _routing(args: argparse.Namespace, model_dir: Path, template: Path, kv_blocks: int | None
                   ) -> dict[str, Any]:
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from asyncrl.agents import AgentEndpoint, ChatRenderer, EndpointConfig
    from asyncrl.engines.pool import EnginePool

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out: dict[str, Any] = {}
    async with _servers(model_dir, 2, template, kv_blocks) as (servers, engines):
        pool = EnginePool(engines, name="pool")
        sides = {"sticky": pool, "roaming": _roaming(pool)}
        stats = {k: {"hits": 0.0, "queries": 0.0, "calls_s": []} for k in sides}
        client = AsyncOpenAI(base_url="http://unused/v1", api_key="bench", max_retries=0)
        for round_ in range(args.rounds + 1):  # round 0 warms both sides up and is not counted
            for side, sampler in sides.items():
                for e in engines:  # every round starts cold
                    await e._api.post("/reset_prefix_cache", body=None)
                before = await _cache_counts(servers)
                async with AgentEndpoint(sampler, ChatRenderer(tok, TEMPLATE), EndpointConfig(token="bench")) as ep:
                    keys = [f"r{round_}s{i}" for i in range(args.sessions)]
                    urls = [ep.open_session(k) for k in keys]
                    times: list[float] = stats[side]["calls_s"] if round_ else []
                    await asyncio.gather(*(_session(client.with_options(base_url=u), i + 1000 * round_, args, times)
                                           for i, u in enumerate(urls)))
                    for k in keys:
                        ep.close_session(k)
                after = await _cache_counts(servers)
                if round_:
                    stats[side]["hits"] += after[0] - before[0]
                    stats[side]["queries"] += after[1] - before[1]
        await client.close()
    for side, s in stats.items():
        out[side] = {"prefix_cache_hit_rate": s["hits"] / s["queries"] if s["queries"] else None,
                     "p50_ms": 1000 * _pct(s["calls_s"], 0.5), "p99_ms": 1000 * _pct(s["calls_s"], 0.99),
                     "calls": len(s["calls_s"])}
    out["ratio_p50"] = out["sticky"]["p50_ms"] / out["roaming"]["p50_ms"]
    out["sessions"], out["turns"], out["kv_blocks"] = args.sessions, args.turns, kv_blocks
    return out


async def _session(client: Any, key: int, args: argparse.Namespace, times: list[float]) -> None:
    messages = [{"role": "system", "content": _session_system(key)}, {"role": "user", "content": f"{key % 89}+1="}]
    for turn in range(args.turns):
        t0 = time.perf_counter()
        r = await client.chat.completions.create(model="asyncrl-policy", messages=messages, max_tokens=8,
                                                 temperature=1.0, seed=key * 10 + turn)
        times.append(time.perf_counter() - t0)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"{turn}+{key % 7}="}]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.load_gen:
        print(json.dumps(asyncio.run(_load_gen(json.loads(args.load_gen)))))
        return 0
    common.set_env()
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    import asyncrl
    from asyncrl.testing.tasks import arithmetic
    from asyncrl.testing.tiny import build_tiny

    result = common.Result("openai_agent", args, argv, module="bench.cpu.openai_agent")
    out: dict[str, Any] = {}
    if "learning" in args.parts:
        out["learning"] = learning(args)
    if {"latency", "routing"} & set(args.parts):
        model_dir = build_tiny(common.CACHE / "models" / "tiny-arith", arithmetic.corpus())
        template = common.CACHE / "openai_agent" / "template.jinja"
        template.parent.mkdir(parents=True, exist_ok=True)
        template.write_text(TEMPLATE)
        if "latency" in args.parts:
            out["latency"] = asyncrl.run(latency(args, model_dir, template))
            print(f"latency: {out['latency']}", flush=True)
        if "routing" in args.parts:
            out["routing"] = asyncrl.run(routing(args, model_dir, template))
            print(f"routing: {out['routing']}", flush=True)
    run = {k: result.doc[k] for k in ("date", "command")} | {"loadavg_at_start": result.doc["hardware"][
        "loadavg_at_start"], "cpu": result.doc["hardware"]["cpu"]}
    for part in out.values():
        part["run"] = run  # each part says when and how it was measured: parts not run now are kept below
    path = result.path()
    if path.exists():
        earlier = json.loads(path.read_text())["results"]
        out = {**{k: v for k, v in earlier.items() if k not in out}, **out}
    result.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
