"""An existing aiohttp service that also produces RL rollouts, in its own process and event loop.

    ASYNCRL_TOKEN=secret python -m asyncrl.examples.embedded_service --model-dir DIR \\
        --port 8080 --ingest-url http://127.0.0.1:8100

The service keeps its own routes (``GET /hello``, ``GET /stats``). In the background it starts an in-process
vLLM engine and a ``Producer`` that sends scored groups to a learner in another process
(``asyncrl.examples.remote_learner``) through a ``RemoteQueueClient``. ``EngineControl`` mounts the control routes
under ``/asyncrl/`` so that learner can pause the engine, publish weights into it and resume it. The service
answers while the engine starts (control calls get 503 until it is up), and keeps answering after the
learner has gone.

Shutdown (the service's side of the handshake in ``asyncrl.engines.embedded.server``):

- the learner closes its queue once its last publication has landed: the producer hears "queue closed" and
  returns, the engine is detached from the control routes (once no pause is held) and closed;
- SIGINT / SIGTERM: the RL part is stopped first, while the HTTP server still takes connections, so a
  learner holding a pause can still resume; only then does the HTTP server stop. (aiohttp's ``run_app``
  would close the listening socket before any cleanup hook runs, hence the runner is driven here.)

Prints one JSON line per event on stdout, and nothing else there: at start-up stdout is moved aside for the
events, and file descriptor 1 points at stderr, so vLLM's log (stdout by default), its engine-core processes
(which inherit descriptor 1) and any stray print go to stderr. ``asyncrl-embedded-service`` runs it too.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from aiohttp import web

import asyncrl
from asyncrl import ProducerConfig, Prompt, PromptSource, RewardGroups, SamplingConfig
from asyncrl.actors.producer import Producer
from asyncrl.aio import first_cause
from asyncrl.engines.embedded import EngineControl
from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig
from asyncrl.examples.common import JsonEvents
from asyncrl.queues.ingest_client import RemoteQueueClient
from asyncrl.testing.tasks import arithmetic

log = logging.getLogger("embedded_service")


EVENTS = JsonEvents()  # this program's event stream (stdout, moved aside at start-up: ``main``)


def emit(event: str, **fields: Any) -> None:
    EVENTS.emit(event, **fields)


@dataclass
class Rollouts:
    """What the service knows about its embedded RL part (shown by GET /stats)."""

    control: EngineControl
    engine: VLLMEngine | None = None
    producer: Producer | None = None
    state: str = "starting"  # starting -> producing -> finished | stopped | failed: ...


ROLLOUTS = web.AppKey("rollouts", Rollouts)


# -- the service's own routes ------------------------------------------------------------------------------


async def hello(request: web.Request) -> web.Response:
    return web.json_response({"hello": "world"})


async def stats(request: web.Request) -> web.Response:
    r = request.app[ROLLOUTS]
    return web.json_response({
        "state": r.state, "engine_version": r.engine.version if r.engine else None,
        "producer": asdict(r.producer.counters) if r.producer else None, **r.control.metrics(),
    })


# -- the embedded producer ---------------------------------------------------------------------------------


def prompts(tokenizer: Any, seed: int) -> Iterator[Prompt]:
    for i, p in enumerate(arithmetic.problems(seed)):
        ids = tuple(tokenizer(p.prompt, add_special_tokens=False).input_ids)
        yield Prompt(f"p{i}", ids, p.prompt, p.answer)


async def produce(r: Rollouts, engine: VLLMEngine, args: argparse.Namespace, token: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    sampling = SamplingConfig(n=args.n, max_tokens=args.max_tokens, temperature=1.0)
    # The learner starts listening only once it has read this engine's version: be patient at first. Once
    # the learner has said "queue closed" the client stops retrying, so patience costs nothing at the end.
    async with RemoteQueueClient(args.ingest_url, token, max_retries=30, max_backoff_s=2.0) as sink:
        r.producer = Producer(engine, PromptSource(prompts(tokenizer, args.seed)),
                              RewardGroups(lambda prompt, sample: arithmetic.reward(sample.text, prompt.answer)), sink,
                              ProducerConfig(sampling=sampling, max_inflight_groups=args.inflight))
        r.state = "producing"
        await r.producer.run()  # returns when the learner closes its queue


async def run_rollouts(r: Rollouts, args: argparse.Namespace, token: str) -> None:
    """Start the engine, produce until the learner closes its queue, then close the engine: only after no
    pause is held (``serving``). A failure of the RL part must not take the service down."""
    cfg = VLLMEngineConfig(model=args.model_dir, dtype="float32", max_model_len=128, max_num_seqs=16)
    try:
        r.engine = await VLLMEngine.start(cfg)  # a cancelled start shuts the half-started engine down
        emit("engine_ready", version=r.engine.version)
        try:
            async with r.control.serving(r.engine):
                await produce(r, r.engine, args, token)
            r.state = "finished"
        finally:
            await r.engine.close()  # runs to its end even while cancelled; vLLM's processes are gone after
            emit("engine_closed")
    except asyncio.CancelledError:
        r.state = "stopped"
        raise
    except Exception as exc:
        log.exception("rollout producer failed")
        r.state = f"failed: {first_cause(exc) if isinstance(exc, ExceptionGroup) else exc!r}"
    finally:
        emit("rollouts_done", state=r.state)


def build_app(token: str) -> web.Application:
    app = web.Application()
    app.add_routes([web.get("/hello", hello), web.get("/stats", stats)])
    control = EngineControl(None, token)  # the engine is attached once it has started
    app.add_routes(control.routes("/asyncrl"))
    app[ROLLOUTS] = Rollouts(control)
    return app


async def serve(args: argparse.Namespace, token: str) -> None:
    app = build_app(token)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
        emit("listening", url=f"http://{args.host}:{args.port}")
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        rollouts = asyncio.create_task(run_rollouts(app[ROLLOUTS], args, token), name="rollouts")
        await stop.wait()
        # The RL part first, while the routes still answer: a learner mid-publication can still resume.
        rollouts.cancel()
        await asyncio.gather(rollouts, return_exceptions=True)
        await app[ROLLOUTS].control.close()
    finally:
        await runner.cleanup()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=(
        "environment: ASYNCRL_TOKEN (required) is the bearer token of the control routes and of the learner's "
        "ingest server; the learner (asyncrl-remote-learner) uses the same one. Events are JSON lines on stdout; "
        "logs go to stderr."))
    p.add_argument("--model-dir", required=True, help="local model directory (tokenizer + safetensors)")
    p.add_argument("--ingest-url", required=True, help="the learner's RolloutIngestServer")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--inflight", type=int, default=2, help="groups in flight")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    token = os.environ.get("ASYNCRL_TOKEN") or sys.exit("set ASYNCRL_TOKEN (the learner uses the same one)")
    EVENTS.take_stdout()  # from here on, anything but an event written to stdout goes to stderr
    # vLLM's log level is the engine config's (VLLMEngineConfig.log_level; a VLLM_LOGGING_LEVEL set here wins).
    for key, value in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
                       "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # This process does no tensor math worth parallelising (vLLM computes in its own worker processes). One
    # intra-op thread keeps torch's OpenMP pool from spinning against the event loop: on a busy 2-core
    # machine it stalled this service's routes for ~200 ms at every weight update.
    torch.set_num_threads(1)
    asyncrl.run(serve(args, token))
    emit("stopped")


if __name__ == "__main__":
    main()
