"""An existing aiohttp service that also produces RL rollouts, in its own process and event loop.

    ASYNCRL_TOKEN=secret python examples/embedded_service.py --model-dir DIR \\
        --port 8080 --ingest-url http://127.0.0.1:8100

The service keeps its own routes (``GET /hello``, ``GET /stats``). Through ``app.cleanup_ctx`` it starts, in
the background, an in-process vLLM engine and a ``Producer`` that ships scored groups to a learner in another
process (``examples/remote_learner.py``) with ``RemoteQueueClient``. ``EngineControl`` mounts the control
routes under ``/asyncrl/`` so that learner can pause the engine, publish weights into it and resume it.

The service answers while the engine starts (control calls get 503 until it is up), and keeps answering if
the learner goes away. SIGINT / SIGTERM: aiohttp runs the cleanup, which cancels the producer and shuts the
engine down (its engine-core process with it). Prints one JSON line per event on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from asyncrl import ProducerConfig, Prompt, PromptSource, SamplingConfig  # noqa: E402
from asyncrl.actors.producer import Producer  # noqa: E402
from asyncrl.aio import first_cause  # noqa: E402
from asyncrl.engines.control import EngineControl  # noqa: E402
from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig  # noqa: E402
from asyncrl.queues.remote import RemoteQueueClient  # noqa: E402
from asyncrl.tasks import arithmetic  # noqa: E402

log = logging.getLogger("embedded_service")


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


@dataclass
class Rollouts:
    """What the service knows about its embedded RL part (shown by GET /stats)."""

    control: EngineControl
    engine: VLLMEngine | None = None
    producer: Producer | None = None
    state: str = "starting"  # starting -> producing -> finished | failed: ...


ROLLOUTS = web.AppKey("rollouts", Rollouts)


# -- the service's own routes ------------------------------------------------------------------------------


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"hello": "world"})


async def stats(request: web.Request) -> web.Response:
    r = request.app[ROLLOUTS]
    return web.json_response({
        "state": r.state, "engine_version": r.engine.version if r.engine else None,
        "producer": asdict(r.producer.stats) if r.producer else None, **r.control.metrics(),
    })


# -- the embedded producer ---------------------------------------------------------------------------------


def prompts(tokenizer: Any, seed: int) -> Iterator[Prompt]:
    for i, p in enumerate(arithmetic.problems(seed)):
        ids = tuple(tokenizer(p.prompt, add_special_tokens=False).input_ids)
        yield Prompt(f"p{i}", ids, p.prompt, p.answer)


# Engine start and shutdown run to the end even when the service is stopped meanwhile: a start abandoned
# half-way, or a shutdown left to a thread nobody waits for, would leave vLLM's engine-core process behind.


async def start_engine(cfg: VLLMEngineConfig) -> VLLMEngine:
    starting = asyncio.ensure_future(VLLMEngine.start(cfg))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        await close_engine(await starting)
        raise


async def close_engine(engine: VLLMEngine) -> None:
    closing = asyncio.ensure_future(engine.close())
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        await closing
        raise
    finally:
        emit("engine_closed")


async def produce(r: Rollouts, args: argparse.Namespace, token: str) -> None:
    from transformers import AutoTokenizer

    cfg = VLLMEngineConfig(model=args.model_dir, dtype="float32", max_model_len=128, max_num_seqs=16)
    try:
        r.engine = await start_engine(cfg)
        r.control.engine = r.engine  # control routes go live
        emit("engine_ready", version=r.engine.version)
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens, temperature=1.0)
        async with RemoteQueueClient(args.ingest_url, token) as sink:
            r.producer = Producer(r.engine, PromptSource(prompts(tokenizer, args.seed)),
                                  lambda prompt, sample: arithmetic.reward(sample.text, prompt.answer), sink,
                                  ProducerConfig(sampling=sampling, max_inflight_groups=args.inflight))
            r.state = "producing"
            await r.producer.run()  # returns when the learner closes its queue
        r.state = "finished"
    except Exception as exc:  # the RL part failing (e.g. the learner gone) must not take the service down
        log.exception("rollout producer failed")
        r.state = f"failed: {first_cause(exc) if isinstance(exc, ExceptionGroup) else exc!r}"
    finally:
        r.control.engine = None
        if r.engine is not None:
            await close_engine(r.engine)


def rollouts_ctx(args: argparse.Namespace, token: str):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        r = app[ROLLOUTS]
        task = asyncio.create_task(produce(r, args, token), name="rollouts")  # owned: cancelled below
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await r.control.close()

    return ctx


def build_app(args: argparse.Namespace, token: str) -> web.Application:
    app = web.Application()
    app.add_routes([web.get("/hello", hello), web.get("/stats", stats)])
    control = EngineControl(None, token)  # the engine is attached once it has started
    app.add_routes(control.routes("/asyncrl"))
    app[ROLLOUTS] = Rollouts(control)
    app.cleanup_ctx.append(rollouts_ctx(args, token))
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="local model directory (tokenizer + safetensors)")
    p.add_argument("--ingest-url", required=True, help="the learner's RolloutIngestServer")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--inflight", type=int, default=2, help="groups in flight")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    token = os.environ.get("ASYNCRL_TOKEN") or sys.exit("set ASYNCRL_TOKEN (the learner uses the same one)")
    for key, value in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                       "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # This process does no tensor math worth parallelising (vLLM computes in its own worker processes). One
    # intra-op thread keeps torch's OpenMP pool from spinning against the event loop: on a busy 2-core
    # machine it stalled this service's routes for ~200 ms at every weight update.
    torch.set_num_threads(1)
    web.run_app(build_app(args, token), host=args.host, port=args.port, shutdown_timeout=5, access_log=None,
                print=lambda _: emit("listening", url=f"http://{args.host}:{args.port}"))
    emit("stopped")
