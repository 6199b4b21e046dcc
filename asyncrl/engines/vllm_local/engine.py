"""All three engine roles over an in-process vLLM ``AsyncLLM`` (vLLM 0.26 and newer, CPU and GPU).

Weights arrive through the engine's one transport (``transports.base``), as its configuration declares: staged
files (``weight_transfer=files``, the path that works on CPU), CUDA IPC into shadow parameters (``cuda_ipc``, the
default on CUDA), either one wrapped by sleep/wake (``sleep``), or LoRA adapters on the frozen base (``lora``).
Versions are stamped by vLLM (0.32+) or tracked here from streamed deltas; an adapter's request has its adapter's.
On CUDA, an engine serving adapters lends its weights to a LoRA learner as its frozen base (``lending``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.aio import TaskOwner, settle, together
from asyncrl.config import SamplingConfig
from asyncrl.engines.common import SpanBuilder, completion_room, finish_reason, stamped_spans
from asyncrl.engines.death import Death, watch_sentinels
from asyncrl.engines.protocols import BaseLender, BehaviourPrecision, Engine, LentBase, WeightUpdate, request_seed
from asyncrl.engines.rpc_dir import make_rpc_dir, remove_rpc_dir, rpc_dir_in_env
from asyncrl.engines.vllm_local.config import (
    VLLMEngineConfig, check_model, engine_args, engine_env, scoped_env, set_vllm_log_level,
)
from asyncrl.engines.lora.transport import AdapterTransport, ServedAdapter
from asyncrl.engines.transports.base import WeightTransport, check_carries
from asyncrl.engines.lora.in_process import LocalAdapterPort, lora_request
from asyncrl.engines.shm_segments import record_segments
from asyncrl.engines.transports.files import FileTransport
from asyncrl.engines.vllm_local.ipc import CudaIpcTransport
from asyncrl.engines.vllm_local.lending import lend
from asyncrl.engines.vllm_local.llm_internals import (
    ClosedLLM,
    dtype_from_name,
    served_precision,
    engine_core_pids,
    engine_core_sentinels,
    fail_requests,
    has_flat_logprobs,
    output_handler,
    drain_outputs,
    quiet_shutdown,
    sampled_logprobs,
    scoring_params,
    validation_error,
    vllm_sampling_params,
)
from asyncrl.engines.vllm_local.sleep import SleepControl, SleepCounters, SleepTransport
from asyncrl.engines.weights import manifest_dtype, read_manifest
from asyncrl.errors import ConfigError, EngineError, PromptRejected
from asyncrl.types import PauseMode, Sample

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 1.0  # bound on waiting for pre-pause outputs to reach their streams


class VLLMEngine(Engine, BaseLender):
    """Sampler, weight target and lifecycle over an ``AsyncLLM`` living in this process's event loop."""

    def __init__(self, llm: Any, cfg: VLLMEngineConfig, name: str = "vllm", rpc_dir: Path | None = None) -> None:
        self._llm = llm
        self._rpc_dir = rpc_dir  # where vLLM put its IPC sockets (rpc_dir.py); removed by close()
        self._cfg = cfg
        self.name = name
        self._version = 0
        self._stamps = hasattr(llm, "update_weight_version")  # vLLM 0.32+: engine stamps outputs
        self._flat = has_flat_logprobs()  # vLLM 0.32+: log-probs as flat lists, not a dict per token
        # vLLM detokenises every step of every request (Python, per token, in this process, on the core the
        # worker needs); the learner needs only ids, so the text is decoded once per finished sample instead.
        self._tokenizer = llm.tokenizer
        # vLLM's own rule: an id is in the vocabulary if the tokenizer or the model (padded above it) has it.
        self._vocab_size = max(llm.tokenizer.max_token_id + 1, llm.model_config.get_vocab_size())
        self._refused = validation_error()
        self._closed = False
        self._death = Death()  # declared when the engine core exits or the output loop fails (``_watch``)
        self._stop_watching: Any = None  # closing it ends the process watcher's thread
        self._sleep: SleepTransport | None = None  # with VLLMEngineConfig.sleep
        self._adapters: AdapterTransport | None = None  # with VLLMEngineConfig.lora
        self._probes = itertools.count()
        self._store_files: list[Path] = []  # vLLM's rendezvous files, removed by close()
        self._transport = self._make_transport()

    def _make_transport(self) -> WeightTransport:
        """The engine's one weight transport, as its configuration declares it."""
        cfg, manifest = self._cfg, read_manifest(self._cfg.model)
        dtype = manifest_dtype(manifest) if cfg.dtype == "auto" else dtype_from_name(cfg.dtype)
        if cfg.lora is not None:
            port = LocalAdapterPort(lambda: self._llm, self._call, self._rpc)
            self._adapters = AdapterTransport(self.name, port, manifest, cfg.lora, dtype)
            return self._adapters
        if cfg.uses_cuda_ipc():
            awake: CudaIpcTransport | FileTransport = CudaIpcTransport(self.name, self._rpc, manifest, dtype)
        else:
            awake = FileTransport(self.name, self._reload, cfg.model, dtype, fatal=(EngineError,))
        if not cfg.sleep:
            return awake
        control = SleepControl(sleep=lambda level, mode: self._call(self._llm.sleep(level, mode)),
                               wake_up=lambda tags: self._call(self._llm.wake_up(tags=tags)),
                               drain=self._drain_outputs, rpc=self._rpc)
        self._sleep = SleepTransport(self.name, awake, control, manifest, dtype)
        return self._sleep

    @classmethod
    async def start(cls, cfg: VLLMEngineConfig, name: str = "vllm") -> VLLMEngine:
        """Start the engine; blocking start-up runs in a thread so the event loop keeps serving. Cancelling
        the start waits for it to finish and shuts the half-started engine down: no process is left behind,
        nor any of vLLM's socket files."""
        check_model(cfg)
        args, env = engine_args(cfg), engine_env(cfg)
        set_vllm_log_level(cfg)  # after engine_args: importing vLLM sets the level from the environment
        rpc_dir = make_rpc_dir()
        async with TaskOwner(f"{name}-start") as owner:  # awaited to its end on every path: a backstop
            starting = owner.start(asyncio.to_thread(start_llm, args, env, rpc_dir))
            try:
                llm = await asyncio.shield(starting)
            except asyncio.CancelledError:  # the start-up thread cannot be stopped: shut down what it starts
                await settle(close_when_started(starting, rpc_dir,
                                                lambda llm: cls(llm, cfg, name, rpc_dir)._abandon()),
                             "closing a cancelled engine start")
                raise
            except BaseException:
                remove_rpc_dir(rpc_dir)  # vLLM has shut down what it had started
                raise
        engine = cls(llm, cfg, name, rpc_dir)
        try:
            engine._watch()
            await engine._rpc("asyncrl_record_ties")
            await engine._rpc("asyncrl_die_with", os.getpid())
            await engine._find_store_files()
            # Its processes' shared memory, so that a later run collects it if we are killed (shm_segments).
            await asyncio.to_thread(record_segments, rpc_dir, engine_core_pids(llm))
            if engine._stamps:
                await engine._call(llm.update_weight_version("0"))
        except BaseException:
            await settle(engine.close(), "closing an engine that failed to start")
            raise
        return engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._cfg.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def behaviour_precision(self) -> BehaviourPrecision:
        return served_precision(self._llm)

    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM``, for callers that need vLLM-specific features."""
        return self._llm

    # -- sampling ----------------------------------------------------------------------------------------

    def sampling_params(self, params: SamplingConfig, request_id: str, max_tokens: int) -> Any:
        """The vLLM ``SamplingParams`` of one sample (public so benchmarks can send exactly the same)."""
        return vllm_sampling_params(params, request_seed(params.seed, request_id), max_tokens, flat=self._flat,
                                    final_only=self._stamps)

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        return await self._generate(prompt_ids, params, request_id, n, base=False)

    async def _generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str, n: int | None,
                        base: bool) -> list[Sample]:
        """``base=True`` (a LoRA engine's ``BaseSampler``) samples the base model, without the adapter, every token
        tagged version 0 (the base never changes)."""
        max_tokens = completion_room(prompt_ids, self._cfg.max_model_len, params.max_tokens)
        self._raise_if_dead()
        ids = [f"{request_id}-{i}" for i in range(params.n if n is None else n)]
        return await together(*(self._one(prompt_ids, self.sampling_params(params, rid, max_tokens), rid, base)
                                for rid in ids))

    def base_sampler(self) -> BaseSampler:
        """A LoRA engine's frozen base as a ``Sampler`` of its own (XPO's reference, without a second engine)."""
        if self._adapters is None:
            raise ConfigError("VLLMEngineConfig.lora", f"engine {self.name} serves no adapters: its weights are "
                                                       "the policy's, not a frozen base")
        return BaseSampler(self)

    async def _one(self, prompt_ids: tuple[int, ...], sp: Any, request_id: str, base: bool = False) -> Sample:
        # vLLM aborts the request itself when this generator is closed by cancellation.
        spans = SpanBuilder()
        version_at_submit = 0 if base else self._version
        token_ids: list[int] = []
        logprobs: list[float] = []
        final = None
        with contextlib.nullcontext() if base else self._hold_adapter() as adapter:
            async for out in self._guard(self._llm.generate({"prompt_token_ids": list(prompt_ids)}, sp,
                                                            request_id=request_id, lora_request=lora_request(adapter)),
                                         request_id):
                comp = out.outputs[0]
                if not self._stamps:  # DELTA: tag the new tokens with the version they arrived under
                    spans.add(self._version, len(comp.token_ids))
                else:
                    token_ids.clear(), logprobs.clear()
                token_ids.extend(comp.token_ids)
                logprobs.extend(sampled_logprobs(self.name, comp))
                final = comp
        if final is None:
            raise EngineError(self.name, f"request {request_id} ended without output")
        if self._adapters is not None:  # every token from the adapter the request was submitted with
            version_spans = stamped_spans([(version_at_submit, 0, len(token_ids))], version_at_submit)
        elif self._stamps:
            stamped = [(int(s.version), s.start, s.end) for s in final.weight_versions or ()]
            version_spans = stamped_spans(stamped, version_at_submit)
        else:
            version_spans = spans.build(version_at_submit)
        return Sample(token_ids=tuple(token_ids), logprobs=tuple(logprobs),
                      finish_reason=finish_reason(self.name, final.finish_reason), version_spans=version_spans,
                      text=self._tokenizer.decode(token_ids, skip_special_tokens=True))

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Log-prob of each token after the first given the tokens before it, at temperature 1, under the weights
        (and adapter) served now: what a publication is checked with (``Learner``'s probe)."""
        self._raise_if_dead()
        sp, request_id = scoring_params(), f"asyncrl-probe-{next(self._probes)}"
        with self._hold_adapter() as adapter:
            async for out in self._guard(self._llm.generate({"prompt_token_ids": list(token_ids)}, sp,
                                                            request_id=request_id, lora_request=lora_request(adapter)),
                                         request_id):
                final = out
        steps = final.prompt_logprobs[1:]
        return [float(step[tok].logprob) for tok, step in zip(token_ids[1:], steps, strict=True)]

    def _hold_adapter(self) -> contextlib.AbstractContextManager[ServedAdapter | None]:
        return self._adapters.hold() if self._adapters is not None else contextlib.nullcontext()

    async def score(self, token_ids: Sequence[int]) -> dict[str, list[float]]:
        return {self.name: await self.prompt_logprobs(token_ids)}

    async def lend_base(self) -> LentBase:
        """The weights this engine serves, mapped into this process over CUDA IPC, for a LoRA learner's frozen
        base (``asyncrl.lora.share_base``); see ``lending`` for when an engine refuses."""
        self._raise_if_dead()
        return await lend(self.name, self._cfg, self._rpc)

    async def _guard(self, stream: Any, request_id: str) -> Any:
        """Re-raise vLLM's errors as ours: a request its validation refused (an id outside the vocabulary...) as
        ``PromptRejected``, errors that mean the engine died as ``EngineError``. Cancellation passes untouched."""
        try:
            async for item in stream:
                yield item
        except self._refused as exc:
            raise PromptRejected(f"engine {self.name} refused request {request_id}: {exc}",
                                 too_long="maximum model length" in str(exc)) from exc
        except Exception as exc:
            if self._closed or self._llm.errored:
                raise EngineError(self.name, f"engine died or closed mid-request ({exc!r})") from exc
            raise

    async def _call(self, coro: Any) -> Any:
        """Await a control call (pause, reload...). vLLM never answers a call to a dead engine core, so
        race it against the engine's death event."""
        try:
            return await self._death.race(coro)
        except (EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:
            if self._closed or self._llm.errored:
                raise EngineError(self.name, f"engine died or closed ({exc!r})") from exc
            raise

    # -- weight target -------------------------------------------------------------------------------------

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._raise_if_dead()
        if self.asleep:  # sleeping paused it already
            return
        # Not ``pause_generation``: it ends with a blind 20 ms sleep so that outputs produced before the pause
        # reach their streams first. We ask the scheduler directly and wait for exactly that delivery.
        await self._call(self._llm.engine_core.pause_scheduler_async(mode=PauseMode(mode).value,
                                                                      clear_cache=clear_cache))
        await self._drain_outputs()

    async def _drain_outputs(self) -> None:
        await drain_outputs(self._llm, self.name, DRAIN_TIMEOUT_S)

    async def resume(self) -> None:
        self._raise_if_dead()
        if self._sleep is None or not await self._sleep.resume():
            await self._call(self._llm.resume_generation())

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        """Check and stage through the engine's transport while generation still runs (files another engine
        of a pool staged are adopted as they are); only the load needs the pause."""
        check_carries(self.name, self._transport, update)  # a kind it does not carry: refused, nothing staged
        return await self._transport.stage(update)

    def release(self, update: WeightUpdate) -> None:
        self._transport.release(update)

    async def load(self, update: WeightUpdate) -> None:
        """Load a prepared update. Runs to its end even if the caller is cancelled meanwhile, so the engine's
        weights and its version always agree."""
        await settle(self._load(update), f"loading version {update.version} into {self.name}")

    async def _load(self, update: WeightUpdate) -> None:
        await self._transport.load(update)  # all-or-nothing: a failure leaves the version as it was
        await self._set_version(update.version)

    async def _rpc(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self._call(self._llm.collective_rpc(method, args=args, kwargs=kwargs or None))

    async def _reload(self, weights_dir: Path) -> None:
        await self._rpc("asyncrl_reload", weights_path=str(weights_dir))

    async def _set_version(self, version: int) -> None:
        if self._stamps:
            await self._call(self._llm.update_weight_version(str(version)))
        self._version = version

    # -- sleeping (VLLMEngineConfig.sleep; see sleep.py) ----------------------------------------------------

    @property
    def sleep_level(self) -> int:
        """The level ``sleep()`` uses (``VLLMEngineConfig.sleep``); 0: this engine never sleeps."""
        return self._cfg.sleep

    @property
    def asleep(self) -> bool:
        return self._sleep is not None and self._sleep.asleep

    @property
    def sleep_counters(self) -> SleepCounters:
        return self._sleep.counters if self._sleep is not None else SleepCounters()

    async def sleep(self, level: int | None = None) -> None:
        """Pause and free the GPU memory at ``level`` (default ``VLLMEngineConfig.sleep``; 1 where a step will
        not publish, since level 2 needs an update to wake). Requests sent meanwhile wait for the wake."""
        if self._sleep is None:
            raise EngineError(self.name, "engine started without sleep mode (VLLMEngineConfig.sleep=0)")
        level = self._cfg.sleep if level is None else level
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        self._raise_if_dead()
        await self._sleep.sleep(level)

    async def wake(self) -> None:
        """Wake fully without an update (see sleep.py for level 2). No-op when awake."""
        self._raise_if_dead()
        if self._sleep is not None:
            await self._sleep.wake()

    # -- lifecycle -----------------------------------------------------------------------------------------

    def _raise_if_dead(self) -> None:
        if self._closed:
            raise EngineError(self.name, "engine is closed")
        if self._llm.errored:
            self._died("engine core process died or its output loop failed")
        if self._death.error is not None:
            raise self._death.error

    async def check_alive(self) -> None:
        self._raise_if_dead()

    async def wait_dead(self) -> EngineError:
        return await self._death.wait()

    def _died(self, why: str) -> None:
        if not self._death.declared:
            self._death.declare(EngineError(self.name, why))
            fail_requests(self._llm, self._death.error)

    def _watch(self) -> None:
        """Declare the death as soon as vLLM's engine-core processes exit (a thread waits on their sentinels,
        beside a pipe that ``close`` closes to end it) or its output loop ends."""
        handler = output_handler(self._llm)
        if handler is not None:
            handler.add_done_callback(lambda _: self._closed or self._died("engine died: its output loop ended"))
        self._stop_watching = watch_sentinels(engine_core_sentinels(self._llm), f"asyncrl-{self.name}-death",
                                              lambda: self._closed or self._died("engine core process died"))

    async def _find_store_files(self) -> None:
        self._store_files = [Path(f) for f in await self._rpc("asyncrl_store_file") if f]

    async def _abandon(self) -> None:
        """Close an engine whose start was cancelled (it may not answer: its processes go all the same)."""
        try:
            await self._find_store_files()
        except Exception:
            log.debug("engine %s: no rendezvous file to remove", self.name, exc_info=True)
        await self.close()

    async def close(self) -> None:
        """Shut vLLM down (its processes gone when this returns) and remove staged weights. Idempotent; runs
        to its end even if the caller is cancelled."""
        if self._closed:
            return
        self._closed = True
        self._death.declare(EngineError(self.name, "engine is closed"))  # calls still pending end now
        fail_requests(self._llm, EngineError(self.name, "engine closed while this request was in flight"))
        if self._stop_watching is not None:
            self._stop_watching.close()
        t0 = time.monotonic()
        try:
            await settle(quiet_shutdown(self._llm), f"shutting down {self.name}")
        finally:
            self._llm = ClosedLLM()  # late calls fail with a clear error instead of reaching a dead engine
            await self._transport.close()
            remove_rpc_dir(self._rpc_dir)
            for path in self._store_files:  # the processes that used them are gone
                path.unlink(missing_ok=True)
            log.info("engine %s shut down in %.1fs", self.name, time.monotonic() - t0)


class BaseSampler:
    """The frozen base under a LoRA engine's adapters, as a ``Sampler`` (``VLLMEngine.base_sampler``): the same
    engine, requests without an adapter, version 0 throughout. Its requests pause and resume with the engine's
    publications."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._engine = engine
        self.name = f"{engine.name}/base"

    @property
    def version(self) -> int:
        return 0

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.vocab_size

    @property
    def behaviour_precision(self) -> BehaviourPrecision:
        return self._engine.behaviour_precision

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        return await self._engine._generate(prompt_ids, params, request_id, n, base=True)


# Starting an AsyncLLM off the event loop: vLLM's start-up blocks for tens of seconds, so it runs in a thread, with
# the sockets it binds in the engine's private directory (``rpc_dir``) and the environment the configuration
# decides set for the start-up only. A thread cannot be stopped: a cancelled start is let finish, then whatever it
# started is shut down.


def start_llm(args: Any, env: dict[str, str], rpc_dir: Path) -> Any:
    """``AsyncLLM.from_engine_args(args)`` (blocking: call it in a thread)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    with rpc_dir_in_env(rpc_dir), scoped_env(env):
        return AsyncLLM.from_engine_args(args)


async def close_when_started(starting: asyncio.Future[Any], rpc_dir: Path,
                             close: Callable[[Any], Awaitable[None]]) -> None:
    """Wait for a cancelled start to end, then ``close(llm)`` what it started (nothing if it failed)."""
    try:
        llm = await starting
    except Exception:
        remove_rpc_dir(rpc_dir)
        return  # it failed to start: vLLM has shut down what it had started
    await close(llm)
