"""The Engine Protocol over an in-process vLLM ``AsyncLLM`` (vLLM 0.26 and newer, CPU and GPU).

Weights are published one of two ways (``VLLMEngineConfig.weight_transfer``, see ``worker_ext``):
``files``: staged as safetensors in shared memory and loaded with vLLM's layerwise reload, the path that works
on CPU (where ``load_weights`` after start-up has no effect); ``cuda_ipc`` (the default on CUDA): handed to the
workers through a CUDA IPC handle and loaded into shadow parameters before the pause, so the pause covers
one device copy. Version tags come from the engine itself where vLLM stamps outputs (0.32+); on older vLLM
they are tracked here from streamed deltas.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asyncrl.aio import together
from asyncrl.config import ConfigError, SamplingConfig
from asyncrl.engines.base import (EngineError, PromptRejected, StagedInEngine, WeightUpdate, WeightUpdateError,
                                  request_seed)
from asyncrl.engines.weights import (first_non_finite, read_manifest, torch_dtype, validate_and_stage,
                                     validate_update)
from asyncrl.engines.worker_ext import EXTENSION as WORKER_EXTENSION
from asyncrl.engines.worker_ext import pack_for_ipc
from asyncrl.types import FinishReason, PauseMode, Sample, VersionSpan

log = logging.getLogger(__name__)

RESTORE_ATTEMPTS = 3  # full reloads of the last good weights after a failed update
EXECUTOR_QUALNAME = "asyncrl.engines.vllm_executor.NappingReadersExecutor"  # loaded by name in EngineCore
ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"
DEATH_POLL_S = 0.25  # how often a pending control call checks whether the engine died
DRAIN_TIMEOUT_S = 1.0  # bound on waiting for pre-pause outputs to reach their streams


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """How the in-process vLLM engine is built."""

    model: str  # local model directory (config.json, tokenizer and *.safetensors)
    dtype: str = "auto"  # weights dtype in the engine ("auto" = the checkpoint's)
    max_model_len: int = 256  # prompt + completion tokens per sequence
    max_num_seqs: int = 64  # sequences scheduled at once
    kv_cache_gib: float = 1.0  # KV cache size (CPU: VLLM_CPU_KVCACHE_SPACE; GPU: kv_cache_memory_bytes)
    gpu_memory_utilization: float = 0.3  # GPU only, used when kv_cache_gib <= 0
    enforce_eager: bool = True  # skip torch.compile / CUDA graphs (fast start, tiny models)
    seed: int = 0
    # "auto": cuda_ipc on a CUDA GPU, files elsewhere. cuda_ipc keeps one extra copy of the weights in the
    # engine's GPU memory (the shadows) and needs the learner on the same host.
    weight_transfer: str = "auto"
    # Whether vLLM's internal queue readers spin for a second after each message (vLLM's default, True) or nap
    # between checks (False, see ``vllm_executor``). None: nap on CPU, where the spinning takes a core from
    # the learner; vLLM's own choice elsewhere.
    busy_wait: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # more AsyncEngineArgs fields, passed as is

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ConfigError("VLLMEngineConfig.model", f"model directory {self.model!r} does not exist")
        if not (Path(self.model) / "config.json").is_file():
            raise ConfigError("VLLMEngineConfig.model", f"{self.model!r} has no config.json")
        if self.weight_transfer not in ("auto", "files", "cuda_ipc"):
            raise ConfigError("VLLMEngineConfig.weight_transfer",
                              f"must be 'auto', 'files' or 'cuda_ipc', got {self.weight_transfer!r}")
        if not (self.busy_wait is None or isinstance(self.busy_wait, bool)):
            raise ConfigError("VLLMEngineConfig.busy_wait", f"must be None, True or False, got {self.busy_wait!r}")
        for name in ("max_model_len", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"VLLMEngineConfig.{name}", f"must be a positive integer, got {value!r}")


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _engine_args(cfg: VLLMEngineConfig) -> Any:
    from vllm import AsyncEngineArgs

    kwargs: dict[str, Any] = dict(
        model=cfg.model, dtype=cfg.dtype, max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager, seed=cfg.seed,
        # Behaviour log-probs must be those of the distribution actually sampled (after temperature).
        logprobs_mode="processed_logprobs",
        use_tqdm_on_load=False,  # a progress bar per weight sync is noise
        worker_extension_cls=WORKER_EXTENSION,  # reload that keeps tied weights tied
    )
    cpu = _is_cpu_platform()
    if (cpu if cfg.busy_wait is None else not cfg.busy_wait):  # nap: asyncrl's executor
        kwargs["distributed_executor_backend"] = EXECUTOR_QUALNAME  # replaced if ``extra`` names another
    if cpu:
        # vLLM CPU reads its KV size from the environment; without it, it takes most of the RAM.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(cfg.kv_cache_gib))))
    else:
        # The learner usually lives in this process and has touched CUDA already: forked workers can't.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if cfg.kv_cache_gib > 0:  # a KV size in bytes also skips the memory-utilisation profiling
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    kwargs.update(cfg.extra)
    return AsyncEngineArgs(**kwargs)


class _Spans:
    """Per-token version spans built from streamed deltas (for vLLM without engine-side stamps)."""

    def __init__(self) -> None:
        self.spans: list[VersionSpan] = []

    def add(self, version: int, start: int, end: int) -> None:
        if end <= start:
            return
        if self.spans and self.spans[-1].version == version and self.spans[-1].end == start:
            self.spans[-1] = VersionSpan(version, self.spans[-1].start, end)
        else:
            self.spans.append(VersionSpan(version, start, end))


class VLLMEngine:
    """``Engine`` over an ``AsyncLLM`` living in this process's event loop."""

    def __init__(self, llm: Any, cfg: VLLMEngineConfig, name: str = "vllm") -> None:
        self._llm = llm
        self._cfg = cfg
        self.name = name
        self._version = 0
        self._stamps = hasattr(llm, "update_weight_version")  # vLLM 0.32+: engine stamps outputs
        self._ipc = cfg.weight_transfer == "cuda_ipc" or (cfg.weight_transfer == "auto" and not _is_cpu_platform())
        self._manifest = read_manifest(cfg.model)
        self._good_weights: Path = Path(cfg.model)  # last weights fully loaded (restored on failure)
        self._staged: Path | None = None  # our staging dir holding _good_weights, deleted when replaced
        self._closed = False

    @classmethod
    async def start(cls, cfg: VLLMEngineConfig, name: str = "vllm") -> VLLMEngine:
        """Start the engine. Blocking start-up runs in a thread so the event loop keeps serving."""
        from vllm.v1.engine.async_llm import AsyncLLM

        args = _engine_args(cfg)
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        engine = cls(llm, cfg, name)
        try:
            await llm.collective_rpc("asyncrl_record_ties")
            if engine._stamps:
                await llm.update_weight_version("0")
        except BaseException:
            await engine.close()
            raise
        return engine

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._cfg.max_model_len

    @property
    def llm(self) -> Any:
        """The underlying ``AsyncLLM``, for callers that need vLLM-specific features."""
        return self._llm

    # -- generation ------------------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingConfig, request_id: str, max_tokens: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1, max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
            seed=request_seed(params.seed, request_id), logprobs=0, ignore_eos=params.ignore_eos,
            output_kind=RequestOutputKind.FINAL_ONLY if self._stamps else RequestOutputKind.DELTA,
        )

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        if not prompt_ids:
            raise PromptRejected("empty prompt")
        room = self._cfg.max_model_len - len(prompt_ids)
        if room <= 0:
            raise PromptRejected(f"prompt of {len(prompt_ids)} tokens leaves no room in a context of "
                                 f"{self._cfg.max_model_len}")
        self._raise_if_dead()
        max_tokens = min(params.max_tokens, room)
        count = params.n if n is None else n
        ids = [f"{request_id}-{i}" for i in range(count)]
        return await together(*(self._one(prompt_ids, self._sampling_params(params, rid, max_tokens), rid)
                                for rid in ids))

    async def _one(self, prompt_ids: tuple[int, ...], sp: Any, request_id: str) -> Sample:
        # vLLM aborts the request itself when this generator is closed by cancellation.
        spans = _Spans()
        token_ids: list[int] = []
        logprobs: list[float] = []
        text: list[str] = []
        final = None
        async for out in self._guard(self._llm.generate({"prompt_token_ids": list(prompt_ids)}, sp,
                                                        request_id=request_id)):
            comp = out.outputs[0]
            if not self._stamps:  # DELTA: tag the new tokens with the version they arrived under
                spans.add(self._version, len(token_ids), len(token_ids) + len(comp.token_ids))
                text.append(comp.text)
            else:
                token_ids.clear(), logprobs.clear()
            token_ids.extend(comp.token_ids)
            logprobs.extend(_sampled_logprobs(comp))
            final = comp
        if final is None:
            raise EngineError(self.name, f"request {request_id} ended without output")
        version_spans = _stamped_spans(final) if self._stamps else tuple(spans.spans)
        return Sample(
            token_ids=tuple(token_ids), logprobs=tuple(logprobs), finish_reason=_finish_reason(final),
            version_spans=version_spans, text=final.text if self._stamps else "".join(text),
        )

    async def _guard(self, stream: Any) -> Any:
        """Re-raise vLLM's errors as ``EngineError`` when they mean the engine died."""
        try:
            async for item in stream:
                yield item
        except Exception as exc:
            if self._closed or self._llm.errored:
                raise EngineError(self.name, f"engine died or closed mid-request ({exc!r})") from exc
            raise

    async def _call(self, coro: Any) -> Any:
        """Await a control call (pause, reload...). vLLM never answers a call to a dead engine core, so
        race it against the engine's death flag (there is no event for it to wait on)."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DEATH_POLL_S)
                if done:
                    return task.result()
                if self._closed or self._llm.errored:
                    raise EngineError(self.name, "engine core process died during a control call")
        except EngineError:
            raise
        except Exception as exc:
            if self._closed or self._llm.errored:
                raise EngineError(self.name, f"engine died or closed ({exc!r})") from exc
            raise
        finally:
            task.cancel()

    # -- weight publication ----------------------------------------------------------------------------

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        self._raise_if_dead()
        # Not ``pause_generation``: it ends with a blind 20 ms sleep so that outputs produced before the
        # pause reach their streams first (half of a GPU sync's pause). We ask the scheduler directly and then
        # wait for exactly that delivery.
        await self._call(self._llm.engine_core.pause_scheduler_async(mode=PauseMode(mode).value,
                                                                      clear_cache=clear_cache))
        await self._drain_outputs()

    async def _drain_outputs(self) -> None:
        """Return once every output produced before the pause has been taken by its request's stream.

        They precede the pause reply on the engine's socket, so they sit in the client's output queue or in
        per-request collectors; when both are empty on two loop turns in a row (the output handler yields
        between chunks), all were consumed. This matters where versions are tagged on arrival (vLLM < 0.32):
        a pre-pause token must not be counted under the new version."""
        pending = _pending_outputs_probe(self._llm)
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
        await self._call(self._llm.resume_generation())

    async def prepare_update(self, update: WeightUpdate) -> WeightUpdate:
        """Validate and stage the update while generation still runs; only the load needs the pause."""
        if update.staged is not None:
            return update
        if self._ipc:
            return await self._stage_in_engine(update)
        staged = await validate_and_stage(update.tensors, self._manifest, self._dtype)
        return replace(update, staged=staged)

    async def _stage_in_engine(self, update: WeightUpdate) -> WeightUpdate:
        """CUDA IPC: snapshot the tensors into one buffer, let the workers load it into their shadows."""
        import torch

        validate_update(update.tensors, self._manifest, check_finite=False)
        first = next(iter(update.tensors.values()))
        device = first.device if first.is_cuda else torch.device("cuda", torch.cuda.current_device())
        flat, payload = await asyncio.to_thread(pack_for_ipc, dict(update.tensors), self._dtype, device)
        try:
            if not bool(torch.isfinite(flat).all()):  # one pass over the snapshot instead of one per tensor
                bad = first_non_finite(update.tensors)
                raise WeightUpdateError(f"parameter {bad}: contains NaN or infinite values")
            await self._call(self._llm.collective_rpc("asyncrl_stage_ipc", args=(payload, update.version)))
        except (EngineError, WeightUpdateError):
            raise
        except Exception as exc:  # e.g. a name vLLM's loader does not know: only the shadows were touched
            raise WeightUpdateError(f"engine {self.name}: staging the update failed ({exc!r}); live weights "
                                    f"untouched, version stays {self._version}") from exc
        finally:
            # The workers copied it (or failed) and dropped their handles; without ipc_collect a buffer shared
            # over IPC may stay reserved in this process after it is freed.
            del flat
            torch.cuda.ipc_collect()
        return replace(update, staged=StagedInEngine(update.version))

    def discard_update(self, update: WeightUpdate) -> None:
        # Shadows staged in the engine stay allocated; the next stage overwrites them.
        if isinstance(update.staged, Path) and update.staged != self._good_weights:
            shutil.rmtree(update.staged, ignore_errors=True)

    async def update_weights(self, update: WeightUpdate) -> None:
        update = await self.prepare_update(update)
        if isinstance(update.staged, StagedInEngine):
            await self._commit_staged(update.version)
            return
        assert isinstance(update.staged, Path)
        try:
            await self._reload(update.staged)
        except BaseException as exc:
            self.discard_update(update)
            await self._restore_after_failed_reload(exc)
            raise WeightUpdateError(f"engine {self.name}: weight reload failed ({exc!r}); previous weights "
                                    f"restored, version stays {self._version}") from exc
        await self._set_version(update.version)
        self._replace_good_weights(update.staged)

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
            return torch_dtype(next(iter(self._manifest.values())).dtype)
        return _dtype_from_name(self._cfg.dtype)

    async def _reload(self, weights_dir: Path) -> None:
        await self._call(self._llm.collective_rpc("asyncrl_reload", kwargs={"weights_path": str(weights_dir)}))

    async def _restore_after_failed_reload(self, exc: BaseException) -> None:
        # A reload that fails part-way can leave some layers new and some old; a full reload of the last
        # good weights puts every layer back.
        log.error("weight reload failed on %s (%r); restoring %s", self.name, exc, self._good_weights)
        try:
            for attempt in range(RESTORE_ATTEMPTS):
                try:
                    await asyncio.shield(self._reload(self._good_weights))
                    break
                except Exception:
                    # The failed load can leave per-layer loading state behind that spoils the next
                    # reload once; the reload after that starts clean.
                    if attempt == RESTORE_ATTEMPTS - 1:
                        raise
                    log.warning("restore attempt %d on %s failed; retrying", attempt + 1, self.name)
        except Exception as restore_exc:
            raise EngineError(self.name, f"weight reload failed and restoring the previous weights failed "
                                         f"too ({restore_exc!r}); the engine's weights are undefined") from exc

    async def _set_version(self, version: int) -> None:
        if self._stamps:
            await self._call(self._llm.update_weight_version(str(version)))
        self._version = version

    def _replace_good_weights(self, staged: Path) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
        self._staged = self._good_weights = staged

    # -- health and shutdown ---------------------------------------------------------------------------

    def _raise_if_dead(self) -> None:
        if self._closed:
            raise EngineError(self.name, "engine is closed")
        if self._llm.errored:
            raise EngineError(self.name, "engine core process died or its output loop failed")

    async def check_alive(self) -> None:
        self._raise_if_dead()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        quiet = _ShutdownNotice()
        logging.getLogger(ASYNC_LLM_LOGGER).addFilter(quiet)
        try:
            await asyncio.shield(asyncio.to_thread(self._llm.shutdown))
            # AsyncLLM.__del__ would shut down a second time (and fail at interpreter exit): make that a no-op,
            # and keep late calls from reaching the dead engine.
            self._llm.shutdown = _no_op
            self._llm = _ClosedLLM()
        finally:
            logging.getLogger(ASYNC_LLM_LOGGER).removeFilter(quiet)
            if self._staged is not None:
                shutil.rmtree(self._staged, ignore_errors=True)
            log.info("engine %s shut down in %.1fs", self.name, time.monotonic() - t0)


class _ShutdownNotice(logging.Filter):
    """Drops the "output_handler failed" traceback that vLLM logs when the engine it is shutting down dies
    under its output task (shutdown stops EngineCore before it cancels that task). The error still reaches
    any request left in flight."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ("output_handler failed" in str(record.msg) and type(exc).__name__ == "EngineDeadError")


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    return None


class _ClosedLLM:
    """Stands in for a shut-down AsyncLLM so late calls fail with a clear error."""

    errored = True


def _pending_outputs_probe(llm: Any) -> Any:
    """A callable telling whether engine outputs are still undelivered, or None if this vLLM lacks the
    internals it reads (the client's output queue and the per-request collectors; present in 0.26-0.32)."""
    queue = getattr(llm.engine_core, "outputs_queue", None)
    states = getattr(getattr(llm, "output_processor", None), "request_states", None)
    if queue is None or states is None or not hasattr(queue, "empty"):
        return None

    def pending() -> bool:
        return not queue.empty() or any(getattr(st.queue, "output", None) is not None
                                        for st in states.values() if st.queue is not None)

    return pending


def _sampled_logprobs(comp: Any) -> list[float]:
    if comp.logprobs is None:
        raise EngineError("vllm", "engine returned no log-probs (logprobs=0 was requested)")
    return [step[tok].logprob for tok, step in zip(comp.token_ids, comp.logprobs)]


def _stamped_spans(comp: Any) -> tuple[VersionSpan, ...]:
    spans = comp.weight_versions or []
    return tuple(VersionSpan(int(s.version), s.start, s.end) for s in spans if s.end > s.start)


def _finish_reason(comp: Any) -> FinishReason:
    reason = comp.finish_reason
    if reason == "abort":
        return FinishReason.ABORT
    if reason == "length":
        return FinishReason.LENGTH
    return FinishReason.STOP


def _dtype_from_name(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16, "half": torch.float16}[name]
