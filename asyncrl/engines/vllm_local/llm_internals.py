"""What the in-process engine reads from, or works around in, vLLM's ``AsyncLLM`` (0.26-0.32).

Kept apart so that each dependency on vLLM internals is in one place and says why it exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncrl.config import SamplingConfig
from asyncrl.engines.protocols import BehaviourPrecision
from asyncrl.errors import EngineError

ASYNC_LLM_LOGGER = "vllm.v1.engine.async_llm"

log = logging.getLogger(__name__)


class ClosedLLM:
    """Stands in for a shut-down AsyncLLM so late calls fail with a clear error."""

    errored = True


def engine_core_sentinels(llm: Any) -> list[Any]:
    """The process sentinels of the engine-core processes vLLM started (readable once a process has exited),
    or [] where this vLLM keeps them elsewhere (its process manager, 0.26-0.32)."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    return list(manager.sentinels()) if manager is not None and hasattr(manager, "sentinels") else []


def engine_core_pids(llm: Any) -> list[int]:
    """The pids of vLLM's engine-core processes (their workers are their children), or [] where it keeps them
    elsewhere."""
    return [proc.pid for proc in _engine_core_processes(llm) if proc.pid is not None]


def output_handler(llm: Any) -> asyncio.Task[None] | None:
    """vLLM's output-handler task, started now if it was not yet (AsyncLLM starts it on the first request when
    it was built outside an event loop, as ``VLLMEngine.start`` does). It ends only when the engine fails."""
    start = getattr(llm, "_run_output_handler", None)
    if start is not None:
        start()
    return getattr(llm, "output_handler", None)


def pending_outputs_probe(llm: Any) -> Callable[[], bool] | None:
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


def scoring_params() -> Any:
    """``SamplingParams`` that score a prompt: each prompt token's log-prob at temperature 1, one token sampled."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


async def drain_outputs(llm: Any, name: str, timeout_s: float) -> None:
    """Return once every output produced before a pause has been taken by its request's stream.

    They precede the pause reply on the engine's socket, so they sit in the client's output queue or in
    per-request collectors; when both are empty on two loop turns in a row (the output handler yields between
    chunks), all were consumed. This matters where versions are tagged on arrival (vLLM < 0.32): a pre-pause
    token must not be counted under the new version."""
    pending = pending_outputs_probe(llm)
    if pending is None:  # a vLLM without these internals: fall back to its own heuristic
        await asyncio.sleep(0.02)
        return
    deadline = time.monotonic() + timeout_s
    clean = 0
    while clean < 2:
        await asyncio.sleep(0)
        clean = 0 if pending() else clean + 1
        if time.monotonic() > deadline:
            log.warning("outputs still pending %.1fs after pausing %s", timeout_s, name)
            return


class _ShutdownNotice(logging.Filter):
    """Drops the "output_handler failed" traceback that vLLM logs when the engine it is shutting down dies
    under its output task (shutdown stops EngineCore before it cancels that task). The error still reaches
    any request left in flight."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ("output_handler failed" in str(record.msg) and type(exc).__name__ == "EngineDeadError")


REAP_S = 10.0  # after vLLM's shutdown, how long its engine-core processes get to be gone


async def quiet_shutdown(llm: Any) -> None:
    """``llm.shutdown()`` in a thread, without its expected error log, and so that ``AsyncLLM.__del__`` later finds
    nothing left to shut down (at interpreter exit it would fail); then the engine-core processes are reaped. vLLM
    joins them for a few seconds only and then sends SIGKILL without waiting: on a loaded machine a process could
    still be there when shutdown returns."""
    procs = _engine_core_processes(llm)
    quiet = _ShutdownNotice()
    logging.getLogger(ASYNC_LLM_LOGGER).addFilter(quiet)
    try:
        await asyncio.to_thread(llm.shutdown)
    finally:
        logging.getLogger(ASYNC_LLM_LOGGER).removeFilter(quiet)
        llm.shutdown = _no_op
        await asyncio.to_thread(_reap, procs, REAP_S)


def _engine_core_processes(llm: Any) -> list[Any]:
    """vLLM's engine-core ``multiprocessing`` processes, or [] where this vLLM keeps them elsewhere."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def _reap(procs: list[Any], timeout_s: float) -> None:
    """Join each process (killing one still alive at the deadline), so none is left, not even as a zombie."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("engine-core process %s still alive %.0fs after shutdown; killing it", proc.pid, timeout_s)
            proc.kill()
            proc.join(5.0)


def _no_op(*_args: Any, **_kwargs: Any) -> None:
    return None


def sampled_logprobs(engine: str, comp: Any) -> list[float]:
    lps = comp.logprobs
    if lps is None:
        raise EngineError(engine, "engine returned no log-probs (logprobs=0 was requested)")
    flat = getattr(lps, "logprobs", None)  # FlatLogprobs: with logprobs=0, one entry per position, in order
    if flat is not None and len(flat) == len(comp.token_ids):
        return flat
    return [step[tok].logprob for tok, step in zip(comp.token_ids, lps)]


def validation_error() -> type[Exception]:
    """The class of vLLM's request validation errors: ``VLLMValidationError`` (0.32; not a ``ValueError`` there),
    plain ``ValueError`` in older releases."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError
    return VLLMValidationError


def has_flat_logprobs() -> bool:
    from vllm import SamplingParams

    return "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ())


def served_precision(llm: Any) -> BehaviourPrecision:
    """The precision vLLM resolved: its dtype ("auto" becomes e.g. bfloat16 for a float32 checkpoint on CPU), the
    quantization it applies (asked for, or read from a quantized checkpoint's config), the KV cache's dtype."""
    cache = llm.vllm_config.cache_config.cache_dtype
    return BehaviourPrecision(str(llm.model_config.dtype).removeprefix("torch."), llm.model_config.quantization,
                              None if cache == "auto" else str(cache))


def dtype_from_name(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16, "half": torch.float16}[name]


def fail_requests(llm: Any, error: Exception) -> None:
    """End every request stream still waiting on ``llm`` with ``error``. vLLM does this itself when its output
    loop sees the engine core die, but a death noticed first by its process sentinel (and the replacement a
    supervisor starts at once, closing this engine) could otherwise leave streams waiting for good."""
    processor = getattr(llm, "output_processor", None)
    if processor is not None:
        processor.propagate_error(error)


def vllm_sampling_params(params: SamplingConfig, seed: int | None, max_tokens: int, *, flat: bool,
                         final_only: bool) -> Any:
    """One sample's ``SamplingParams``: log-probs of the sampled tokens (``flat``: vLLM 0.32's flat lists), no
    detokenising (the engine decodes each finished sample once), and outputs streamed as deltas unless the
    engine stamps versions itself (``final_only``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra: dict[str, Any] = {"flat_logprobs": True} if flat else {}
    if params.stop_token_ids:
        extra["stop_token_ids"] = list(params.stop_token_ids)
    return SamplingParams(
        n=1, max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p, seed=seed, logprobs=0,
        ignore_eos=params.ignore_eos, detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA, **extra)
