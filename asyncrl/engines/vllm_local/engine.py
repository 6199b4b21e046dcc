"""All three engine roles over an in-process vLLM ``AsyncLLM`` (vLLM 0.26 and newer, CPU and GPU).

Weights are published one of two ways (``VLLMEngineConfig.weight_transfer``, see ``worker_ext``): ``files``:
staged as safetensors in shared memory and loaded with vLLM's layerwise reload, the path that works on CPU
(where ``load_weights`` after start-up has no effect); ``cuda_ipc`` (the default on CUDA): handed to the
workers through a CUDA IPC handle and loaded into shadow parameters before the pause, so the pause covers one
device copy. With ``VLLMEngineConfig.sleep`` it can also free its GPU memory while a colocated learner trains
(``sleep`` / ``wake``, see ``sleep.py``). Version tags come from the engine itself where vLLM stamps outputs
(0.32+); on older vLLM they are tracked here from streamed deltas.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.aio import settle, together
from asyncrl.config import SamplingConfig
from asyncrl.engines.common import SpanBuilder, completion_room, finish_reason, restore_good_weights, stamped_spans
from asyncrl.engines.death import Death
from asyncrl.engines.protocols import Engine, StagedInEngine, WeightUpdate, request_seed
from asyncrl.engines.rpc_dir import make_rpc_dir, remove_rpc_dir, rpc_dir_in_env
from asyncrl.engines.env import scoped_env
from asyncrl.engines.vllm_local.config import VLLMEngineConfig, check_model, engine_args, engine_env, set_vllm_log_level
from asyncrl.engines.vllm_local.ipc import stage_in_engine
from asyncrl.engines.vllm_local.llm_internals import (
    ClosedLLM,
    dtype_from_name,
    served_dtype,
    engine_core_sentinels,
    fail_requests,
    has_flat_logprobs,
    output_handler,
    pending_outputs_probe,
    quiet_shutdown,
    sampled_logprobs,
    validation_error,
)
from asyncrl.engines.vllm_local.sleep import SleepMixin
from asyncrl.engines.weights import StagedWeights, manifest_dtype, read_manifest, validate_and_stage
from asyncrl.errors import EngineError, PromptRejected, WeightUpdateError
from asyncrl.types import PauseMode, Sample

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 1.0  # bound on waiting for pre-pause outputs to reach their streams


class VLLMEngine(SleepMixin, Engine):
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
        self._ipc = cfg.uses_cuda_ipc()
        self._manifest = read_manifest(cfg.model)
        # The last weights fully loaded, restored after a failed reload (the checkpoint itself at first).
        self._good = StagedWeights(Path(cfg.model), owned=False)
        self._closed = False
        self._death = Death()  # declared when the engine core exits or the output loop fails (``_watch``)
        self._stop_watching: Any = None  # closing it ends the process watcher's thread
        self._init_sleep()

    @classmethod
    async def start(cls, cfg: VLLMEngineConfig, name: str = "vllm") -> VLLMEngine:
        """Start the engine; blocking start-up runs in a thread so the event loop keeps serving. Cancelling
        the start waits for it to finish and shuts the half-started engine down: no process is left behind,
        nor any of vLLM's socket files."""
        check_model(cfg)
        args, env = engine_args(cfg), engine_env(cfg)
        set_vllm_log_level(cfg)  # after engine_args: importing vLLM sets the level from the environment
        rpc_dir = make_rpc_dir()
        starting = asyncio.ensure_future(asyncio.to_thread(_start_llm, args, env, rpc_dir))
        try:
            llm = await asyncio.shield(starting)
        except asyncio.CancelledError:  # the start-up thread cannot be stopped: shut down what it starts
            await settle(_close_when_started(starting, cfg, name, rpc_dir), "closing a cancelled engine start")
            raise
        except BaseException:
            remove_rpc_dir(rpc_dir)  # vLLM has shut down what it had started
            raise
        engine = cls(llm, cfg, name, rpc_dir)
        try:
            engine._watch()
            await engine._call(llm.collective_rpc("asyncrl_record_ties"))
            await engine._call(llm.collective_rpc("asyncrl_die_with", args=(os.getpid(),)))
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
    def serving_dtype(self) -> str:
        return served_dtype(self._llm)

    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM``, for callers that need vLLM-specific features."""
        return self._llm

    # -- sampling ----------------------------------------------------------------------------------------

    def sampling_params(self, params: SamplingConfig, request_id: str, max_tokens: int) -> Any:
        """The vLLM ``SamplingParams`` of one sample (public so benchmarks can send exactly the same)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        extra: dict[str, Any] = {"flat_logprobs": True} if self._flat else {}
        if params.stop_token_ids:
            extra["stop_token_ids"] = list(params.stop_token_ids)
        return SamplingParams(
            n=1, max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
            seed=request_seed(params.seed, request_id), logprobs=0, ignore_eos=params.ignore_eos,
            detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY if self._stamps else RequestOutputKind.DELTA,
            **extra)

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        max_tokens = completion_room(prompt_ids, self._cfg.max_model_len, params.max_tokens)
        self._raise_if_dead()
        ids = [f"{request_id}-{i}" for i in range(params.n if n is None else n)]
        return await together(*(self._one(prompt_ids, self.sampling_params(params, rid, max_tokens), rid)
                                for rid in ids))

    async def _one(self, prompt_ids: tuple[int, ...], sp: Any, request_id: str) -> Sample:
        # vLLM aborts the request itself when this generator is closed by cancellation.
        spans = SpanBuilder()
        version_at_submit = self._version
        token_ids: list[int] = []
        logprobs: list[float] = []
        final = None
        async for out in self._guard(self._llm.generate({"prompt_token_ids": list(prompt_ids)}, sp,
                                                        request_id=request_id), request_id):
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
        if self._stamps:
            stamped = [(int(s.version), s.start, s.end) for s in final.weight_versions or ()]
            version_spans = stamped_spans(stamped, version_at_submit)
        else:
            version_spans = spans.build(version_at_submit)
        return Sample(token_ids=tuple(token_ids), logprobs=tuple(logprobs),
                      finish_reason=finish_reason(self.name, final.finish_reason), version_spans=version_spans,
                      text=self._tokenizer.decode(token_ids, skip_special_tokens=True))

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
        """Return once every output produced before the pause has been taken by its request's stream.

        They precede the pause reply on the engine's socket, so they sit in the client's output queue or in
        per-request collectors; when both are empty on two loop turns in a row (the output handler yields
        between chunks), all were consumed. This matters where versions are tagged on arrival (vLLM < 0.32):
        a pre-pause token must not be counted under the new version."""
        pending = pending_outputs_probe(self._llm)
        if pending is None:  # a vLLM without these internals: fall back to its own heuristic
            await asyncio.sleep(0.02)
            return
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        clean = 0
        while clean < 2:
            await asyncio.sleep(0)
            clean = 0 if pending() else clean + 1
            if time.monotonic() > deadline:
                log.warning("outputs still pending %.1fs after pausing %s", DRAIN_TIMEOUT_S, self.name)
                return

    async def resume(self) -> None:
        self._raise_if_dead()
        if not await self._resume_asleep():
            await self._call(self._llm.resume_generation())

    async def prepare(self, update: WeightUpdate) -> WeightUpdate:
        """Validate and stage the update while generation still runs; only the load needs the pause. An update
        another engine of a pool already staged as files is adopted as it is."""
        if (packed := await self._prepare_asleep(update)) is not None:
            return packed
        if self._ipc:
            staged = await stage_in_engine(self.name, self._call, self._llm, update, self._manifest,
                                           self._dtype)
            return replace(update, staged=staged)
        if isinstance(update.staged, StagedWeights):
            return replace(update, staged=update.staged.acquire())
        return replace(update, staged=await validate_and_stage(update.tensors, self._manifest, self._dtype))

    def release(self, update: WeightUpdate) -> None:
        # Shadows staged in the engine stay allocated; the next stage overwrites them.
        self._release_packed(update)
        if isinstance(update.staged, StagedWeights):
            update.staged.release()

    async def load(self, update: WeightUpdate) -> None:
        """Load a prepared update. Runs to its end even if the caller is cancelled meanwhile, so the engine's
        weights and its version always agree."""
        await settle(self._load(update), f"loading version {update.version} into {self.name}")

    async def _load(self, update: WeightUpdate) -> None:
        if await self._load_asleep(update):
            return
        if isinstance(update.staged, StagedInEngine):
            await self._commit_staged(update.version)
            self._weights_lost = False
            return
        if not isinstance(update.staged, StagedWeights):
            raise WeightUpdateError(f"engine {self.name}: version {update.version} was not prepared")
        try:
            await self._reload(update.staged.path)
        except EngineError:
            raise
        except Exception as exc:
            await restore_good_weights(self.name, self._reload, self._good.path, exc)
            raise WeightUpdateError(f"engine {self.name}: weight reload failed ({exc!r}); previous weights "
                                    f"restored, version stays {self._version}") from exc
        await self._set_version(update.version)
        self._weights_lost = False
        previous, self._good = self._good, update.staged.acquire()
        previous.release()

    async def _commit_staged(self, version: int) -> None:
        # The commit checks the staged version before copying anything, so a refusal leaves the live
        # weights as they were; a fault during the device copy kills the engine (EngineError).
        try:
            await self._call(self._llm.collective_rpc("asyncrl_commit", args=(version,)))
        except EngineError:
            raise
        except Exception as exc:
            raise WeightUpdateError(f"engine {self.name}: commit of staged weights failed ({exc!r}); "
                                    f"version stays {self._version}") from exc
        await self._set_version(version)

    @property
    def _dtype(self) -> Any:
        if self._cfg.dtype == "auto":
            return manifest_dtype(self._manifest)
        return dtype_from_name(self._cfg.dtype)

    async def _reload(self, weights_dir: Path) -> None:
        await self._call(self._llm.collective_rpc("asyncrl_reload", kwargs={"weights_path": str(weights_dir)}))

    async def _set_version(self, version: int) -> None:
        if self._stamps:
            await self._call(self._llm.update_weight_version(str(version)))
        self._version = version

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
        sentinels = engine_core_sentinels(self._llm)
        if not sentinels:
            return
        loop = asyncio.get_running_loop()
        stop_r, self._stop_watching = multiprocessing.Pipe(duplex=False)

        def watch() -> None:
            with stop_r:
                if stop_r in multiprocessing.connection.wait([*sentinels, stop_r]):
                    return  # closed: the processes exit because we asked them to
            try:
                loop.call_soon_threadsafe(lambda: self._closed or self._died("engine core process died"))
            except RuntimeError:  # the event loop is gone: nobody is left to tell
                pass

        threading.Thread(target=watch, name=f"asyncrl-{self.name}-death", daemon=True).start()

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
            self._good.release()
            remove_rpc_dir(self._rpc_dir)
            log.info("engine %s shut down in %.1fs", self.name, time.monotonic() - t0)


def _start_llm(args: Any, env: dict[str, str], rpc_dir: Path) -> Any:
    from vllm.v1.engine.async_llm import AsyncLLM

    # The sockets bound here and by the processes it spawns go to rpc_dir; env holds for the start-up only.
    with rpc_dir_in_env(rpc_dir), scoped_env(env):
        return AsyncLLM.from_engine_args(args)


async def _close_when_started(starting: asyncio.Future[Any], cfg: VLLMEngineConfig, name: str,
                              rpc_dir: Path) -> None:
    try:
        llm = await starting
    except Exception:
        remove_rpc_dir(rpc_dir)
        return  # it failed to start: nothing runs
    await VLLMEngine(llm, cfg, name, rpc_dir).close()
