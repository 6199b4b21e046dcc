"""Producers inside an existing service, end to end: ``asyncrl.examples.remote_learner`` and
``asyncrl.examples.embedded_service`` as real processes on loopback (engine control and the shutdown handshake on
fakes are in test_embedded_service_control.py and test_embedded_service_shutdown.py).

The ``vllm`` test measures the service's own endpoint latency while rollouts stream and weights are published,
and checks the shutdown: the learner's Ctrl-C ends the service's producer and then its engine, SIGTERM ends the
service, and no process is left behind. It waits on the processes' JSON event lines and on HTTP answers, each
with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import secrets
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from asyncrl.engines.vllm_remote.process import free_port
from tests.support import command_line

pytestmark = pytest.mark.filterwarnings("error")

REPO = Path(__file__).resolve().parents[3]

PROBE_GAP_S = 0.02  # cadence of the latency probes (a measurement rate, not a wait for an event)
MIN_PROBES = 200
# The embedded service's p99 may exceed a bare aiohttp server's p99, probed at the same moments on the same
# machine, by at most this much. The baseline takes out machine-wide scheduling stalls: on a 2-core machine
# shared with other vLLM runs (load 10+), both servers see 100-400 ms stalls while their CPU time stands still.
LATENCY_P99_BOUND_S = 0.5
EXIT_S = 10.0
BARE_SERVICE = """
import json, sys
from aiohttp import web
app = web.Application()
app.router.add_get("/hello", lambda request: web.json_response({"hello": "world"}))
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None,
            print=lambda _: print(json.dumps({"event": "listening"}), flush=True))
"""


class Child:
    """A child process whose stdout JSON event lines are collected as they come (stderr goes to a file)."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name, self.proc, self.log = name, proc, log
        self.events: list[dict[str, Any]] = []
        self.stray: list[str] = []  # stdout lines that are not JSON events: a pipe reading stdout would choke
        self.tail: deque[str] = deque(maxlen=40)
        self._changed = asyncio.Condition()
        self._eof = False
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> Child:
        log = log_dir / f"{name}.stderr"
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, *argv, cwd=REPO, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=err, start_new_session=True, limit=1 << 20)
        return cls(name, proc, log)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.tail.append(line)
            async with self._changed:
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    self.stray.append(line)
                self._changed.notify_all()
        async with self._changed:
            self._eof = True
            self._changed.notify_all()

    async def wait_for(self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict:
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                while True:
                    found = next((e for e in self.events if predicate(e)), None)
                    if found is not None:
                        return found
                    if self._eof:
                        raise AssertionError(f"{self.name} exited before {what}\n{self.diagnostics()}")
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"{self.name}: no {what} within {timeout_s:.0f}s\n{self.diagnostics()}") from None

    def event(self, name: str) -> Callable[[dict[str, Any]], bool]:
        return lambda e: e["event"] == name

    def diagnostics(self) -> str:
        err = self.log.read_text(errors="replace").splitlines()[-30:] if self.log.exists() else []
        return f"--- {self.name} stdout tail\n" + "\n".join(self.tail) + "\n--- stderr tail\n" + "\n".join(err)

    def tree(self) -> list[psutil.Process]:
        """The process and its live descendants."""
        try:
            root = psutil.Process(self.proc.pid)
            return [p for p in [root, *root.children(recursive=True)] if p.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            return []

    async def kill_leftovers(self) -> None:
        """Safety net for a failed test: SIGKILL the process, its descendants and its session."""
        for p in self.tree():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await self.proc.wait()
        await self._reader


async def stop(child: Child, sig: signal.Signals) -> float:
    """Signal ``child``; assert it and all its descendants exit (code 0) within EXIT_S. Returns the time taken.

    The child itself is awaited through asyncio only: psutil waiting on it would reap it first, and asyncio
    then reports exit code 255 for a process it can no longer find (this made the test flaky)."""
    descendants = [p for p in child.tree() if p.pid != child.proc.pid]
    t0 = time.monotonic()
    child.proc.send_signal(sig)
    try:
        code = await asyncio.wait_for(child.proc.wait(), EXIT_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"{child.name}: still running {EXIT_S:.0f}s after {sig.name}\n{child.diagnostics()}")
    left = max(0.1, EXIT_S - (time.monotonic() - t0))
    _, alive = await asyncio.to_thread(psutil.wait_procs, descendants, timeout=left)
    took = time.monotonic() - t0
    assert not alive, f"{child.name}: children still running {EXIT_S:.0f}s after {sig.name}: {alive}\n" \
                      f"{child.diagnostics()}"
    assert code == 0, f"{child.name} exited with code {code} after {sig.name}\n{child.diagnostics()}"
    return took


def engine_processes(child: Child) -> list[psutil.Process]:
    """The child's live descendants, but multiprocessing's resource tracker (it lives as long as its parent)."""
    return [p for p in child.tree()[1:] if (line := command_line(p)) is not None and "resource_tracker" not in line]


async def probe_latency(session: aiohttp.ClientSession, urls: dict[str, str],
                        until: asyncio.Future[Any]) -> dict[str, list[float]]:
    """GET each of ``urls`` in turn, at a steady cadence, until ``until`` is done and each answered MIN_PROBES."""
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    while len(latencies[next(iter(urls))]) < MIN_PROBES or not until.done():
        for name, url in urls.items():
            t0 = time.perf_counter()
            async with session.get(url) as resp:
                assert resp.status == 200 and (await resp.json()) == {"hello": "world"}
            latencies[name].append(time.perf_counter() - t0)
            await asyncio.sleep(PROBE_GAP_S)
    return latencies


async def http_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


@pytest.mark.vllm
@pytest.mark.timeout(420)
async def test_embedded_service_serves_its_routes_while_a_remote_learner_trains(tiny_model_dir: Path,
                                                                                 tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("service", "ingest", "bare")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    # vLLM at INFO: its log (to stdout by default, in the service and in its engine-core processes) must still
    # not reach the service's stdout, which carries only JSON events.
    env = {**os.environ, "ASYNCRL_TOKEN": secrets.token_urlsafe(16), "VLLM_LOGGING_LEVEL": "INFO"}
    model = ["--model-dir", str(tiny_model_dir)]
    children: list[Child] = []
    try:
        for name, argv in [
            ("learner", ["-m", "asyncrl.examples.remote_learner", *model, "--port", str(ports["ingest"]),
                         "--service-url", url["service"], "--steps", "1000"]),
            ("service", ["-m", "asyncrl.examples.embedded_service", *model, "--port", str(ports["service"]),
                         "--ingest-url", url["ingest"]]),
            ("bare", ["-c", BARE_SERVICE, str(ports["bare"])]),
        ]:
            children.append(await Child.start(name, argv, env, tmp_path))
        learner, service, bare = children
        for child in (service, bare):
            await child.wait_for("listening", child.event("listening"), 90)
        figures = await measure_while_training(learner, service, url)
        figures["shutdown_s"] = await shut_down(learner, service, url)
        for child in (learner, service):
            assert child.stray == [], f"{child.name} wrote lines that are not JSON to stdout:\n" + "\n".join(
                child.stray[:20])
        assert "INFO" in service.log.read_text(errors="replace"), "vLLM's log should have gone to stderr"
        # Written under tmp_path, never into the repository; printed so a run can be copied into bench/results.
        result = tmp_path / "embedded_latency_cpu.json"
        result.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures: {result}")
    finally:
        for child in children:
            await child.kill_leftovers()


async def measure_while_training(learner: Child, service: Child, url: dict[str, str]) -> dict[str, Any]:
    """Probe the service's own route (and a bare aiohttp server) while the learner trains and publishes."""
    async with aiohttp.ClientSession() as session:
        assert await http_json(session, f"{url['service']}/hello") == {"hello": "world"}  # before the engine
        await service.wait_for("engine start", service.event("engine_ready"), 240)
        # The learner listens once it has read the engine's version; the producer retries until then.
        await learner.wait_for("ingest ready", learner.event("ready"), 90)
        first = await learner.wait_for("first step", learner.event("step"), 120)
        later = asyncio.ensure_future(learner.wait_for(
            "two more publications", lambda e: e["event"] == "step" and e["version"] >= first["version"] + 2, 120))
        try:
            latencies = await probe_latency(
                session, {"embedded": f"{url['service']}/hello", "bare": f"{url['bare']}/hello"}, later)
        finally:
            later.cancel()
        last = await later
        stats = await http_json(session, f"{url['service']}/stats")
    assert last["groups_received"] > 0 and last["samples_trained"] > 0 and last["step"] >= 2
    assert stats["state"] == "producing" and stats["producer"]["groups"] >= last["groups_received"]
    assert stats["engine_version"] >= last["version"] >= 2 and stats["control/weights_200"] >= 2

    figures = latency_figures(latencies, first, last)
    emb, ref = figures["embedded"], figures["bare_aiohttp"]
    print(f"\nGET /hello while rollouts stream ({figures['publications_during']} publications): "
          f"n={emb['n']} p50={emb['p50_ms']} ms p99={emb['p99_ms']} ms max={emb['max_ms']} ms; "
          f"bare aiohttp at the same moments p50={ref['p50_ms']} ms p99={ref['p99_ms']} ms max={ref['max_ms']} ms")
    assert emb["p99_ms"] < ref["p99_ms"] + LATENCY_P99_BOUND_S * 1000, figures
    return figures


async def shut_down(learner: Child, service: Child, url: dict[str, str]) -> dict[str, float]:
    """The handshake across processes. Ctrl-C stops the learner within EXIT_S; its last publication lands
    first, so it exits 0 without a 503 from the service. Its queue closing ends the service's producer
    normally (not after connection retries), and then the service's engine and its processes. The service
    keeps serving until SIGTERM, and then it, and everything it started, is gone within EXIT_S."""
    assert len(service.tree()) >= 3, "the service should own vLLM's engine-core and worker processes"
    t0 = time.monotonic()
    learner_s = await stop(learner, signal.SIGINT)
    await learner.wait_for("stopped", learner.event("stopped"), EXIT_S)
    await service.wait_for("engine closed", service.event("engine_closed"), EXIT_S)
    engine_s = time.monotonic() - t0
    done = await service.wait_for("rollouts done", service.event("rollouts_done"), EXIT_S)
    assert done["state"] == "finished", service.diagnostics()
    assert engine_processes(service) == [], "vLLM's processes outlived the engine"
    async with aiohttp.ClientSession() as session:
        assert (await http_json(session, f"{url['service']}/stats"))["state"] == "finished"
        assert await http_json(session, f"{url['service']}/hello") == {"hello": "world"}
    service_s = await stop(service, signal.SIGTERM)
    await service.wait_for("stopped", service.event("stopped"), EXIT_S)
    for child in (learner, service):
        err = child.log.read_text(errors="replace")
        assert "Exception ignored" not in err, f"{child.name}: something failed at exit\n{child.diagnostics()}"
    learner_err = learner.log.read_text(errors="replace")
    assert "HTTP 503" not in learner_err and "Traceback" not in learner_err, learner.diagnostics()
    print(f"learner gone {learner_s:.1f}s after SIGINT; service's producer and engine done {engine_s:.1f}s after it; "
          f"service gone {service_s:.1f}s after SIGTERM")
    return {"learner_after_sigint": round(learner_s, 2), "service_engine_after_sigint": round(engine_s, 2),
            "service_after_sigterm": round(service_s, 2)}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary_ms(latencies: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies]
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 2), "p90_ms": round(percentile(ms, 90), 2),
            "p99_ms": round(percentile(ms, 99), 2), "max_ms": round(max(ms), 2),
            "mean_ms": round(statistics.mean(ms), 2)}


def latency_figures(latencies: dict[str, list[float]], first: dict[str, Any], last: dict[str, Any]) -> dict[str, Any]:
    return {
        "what": "GET /hello of an aiohttp service embedding a vLLM engine and a producer in its event loop, while "
                "rollouts stream to a learner in another process that publishes weights into it; 'bare_aiohttp' "
                "is a plain aiohttp server probed alternately at the same moments (the machine's own noise)",
        "embedded": summary_ms(latencies["embedded"]), "bare_aiohttp": summary_ms(latencies["bare"]),
        "probe_gap_s": PROBE_GAP_S, "publications_during": last["version"] - first["version"],
        "learner_steps_during": last["step"] - first["step"], "sync_s_last": round(last["sync_s"], 3),
        "model": "tiny-arith (Qwen2, 2 layers, hidden 128)",
        "sampling": {"n": 4, "max_tokens": 8, "inflight_groups": 2},
        "machine": {"cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
                    "platform": platform.platform(), "python": platform.python_version()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": "tests/engines/embedded/test_embedded_service.py",
    }
