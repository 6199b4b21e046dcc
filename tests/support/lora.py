"""Shared by the LoRA tests (not fixtures): a tiny Qwen2 wrapped with an adapter, an adapter moved off zero, one
learner step through ``LocalBackend``, and adapter publications across requests in flight on a real engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncrl.actors.training import LocalBackend
from asyncrl.algorithms import GRPOLoss, LossConfig
from asyncrl.config import LearnerConfig
from asyncrl.actors.probe import policy_logprobs
from asyncrl.config import SamplingConfig, SyncConfig
from asyncrl.engines.lora.server import RemoteAdapterPort
from asyncrl.engines.lora.transport import ServedAdapter
from asyncrl.engines.updates import AdapterWeights, WeightUpdate
from asyncrl.engines.weights import STAGING_PREFIX, staging_root
from asyncrl.lora import LoraConfig, LoraReference, adapter_state, apply_lora
from asyncrl.types import FinishReason, PauseMode, Sample
from asyncrl.versions import VersionClock
from asyncrl.actors.weight_sync import WeightSync
from asyncrl.recipes import default_optimizer
from tests.support.algorithms import _model
from tests.support.vllm_engine import _first_token_seen

CONFIG = LoraConfig(rank=4, alpha=8)
LEARNER = LearnerConfig(lr=1e-2)


def lora_model(config: LoraConfig = CONFIG) -> torch.nn.Module:
    """The same tiny Qwen2 every call (seed 0), wrapped with a fresh adapter (seed 1), in train mode."""
    base = _model()
    torch.manual_seed(1)
    return apply_lora(base, config).train()


def nudge_adapter(model: torch.nn.Module, seed: int = 2) -> None:
    """Give every adapter ``B`` (zero when made) random values, so the adapter changes the model's output."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05)


def backend(model: torch.nn.Module, kl_coef: float = 0.0) -> LocalBackend:
    """A ``LocalBackend`` with the default optimiser and GRPO; with ``kl_coef`` its reference is the base model."""
    loss = GRPOLoss(LossConfig(kl_coef=kl_coef), ref_model=LoraReference() if kl_coef else None)
    return LocalBackend(model, default_optimizer(model, LEARNER), loss, LEARNER)


# -- publication into a real engine (tests/lora/test_lora_publication.py, test_lora_gpu.py) ----------------

ADAPTER = LoraConfig(rank=8, alpha=16)


def peft_model(model_dir: Path, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
               ) -> torch.nn.Module:
    """The served base wrapped with an adapter of its own (``seed``), moved off zero so it changes the output."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    model = apply_lora(base, ADAPTER)
    nudge_adapter(model, seed)
    return model.eval()


def adapter_source(model: torch.nn.Module) -> AdapterWeights:
    """What publishing ``model`` sends, copied (the caller may change the model afterwards)."""
    return AdapterWeights({k: v.detach().clone() for k, v in adapter_state(model).items()}, ADAPTER)


def sample_gaps(model: torch.nn.Module, prompt: tuple[int, ...], samples: list[Sample]) -> list[float]:
    """Per token, the gap between the engine's sampled log-prob and ``model``'s for the same token."""
    gaps: list[float] = []
    for s in samples:
        ref = policy_logprobs(model, prompt + s.token_ids)[len(prompt) - 1:]
        gaps.extend(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True))
    return gaps


async def _flowing(engine: Any, task: asyncio.Task[list[Sample]]) -> None:
    """Returns once ``task``'s requests are generating."""
    from asyncrl.engines.vllm_local import VLLMEngine

    if isinstance(engine, VLLMEngine):
        await _first_token_seen(engine)
        return
    async with asyncio.timeout(60):  # a server's progress has no event to await: check it every 10 ms
        while not task.done() and min(engine.inflight().values(), default=0) < 1:
            await asyncio.sleep(0.01)


async def swap_across_requests(engine: Any, mode: PauseMode, old: torch.nn.Module, new: torch.nn.Module,
                               prompt: tuple[int, ...], tol: float, gap: Callable[[list[float]], float] = max
                               ) -> None:
    """Publish ``new`` over ``old`` (already served) while requests run, in ``mode``; check both sides. ``gap``
    reduces the per-token gaps to the figure compared with ``tol`` (the largest; the mean in bfloat16)."""
    before = engine.version
    # Staged before the requests start, so the pause lands while they run, however slow staging is on a loaded
    # machine (a publication stages first, and requests this short could end meanwhile); then the pause, load
    # and resume a publication does.
    update = await engine.prepare(WeightUpdate(before + 1, adapter_source(new)))
    # Registered before the pause: only the switch to it is left for the pause.
    assert await engine._adapters._port.holds(ServedAdapter.of_version(before + 1))
    try:
        long = SamplingConfig(n=2, max_tokens=engine.max_model_len - len(prompt), ignore_eos=True, seed=3)
        task = asyncio.create_task(engine.generate(prompt, long, f"inflight-{mode.value}"))
        await _flowing(engine, task)
        await engine.pause(mode, True)
        try:
            await engine.load(update)
        finally:
            await engine.resume()
    finally:
        engine.release(update)
    assert engine.version == before + 1
    inflight = await asyncio.wait_for(task, 120)
    # Every token of a request in flight across the swap came from the adapter it was submitted with.
    spans = [[(v.version, v.start, v.end) for v in s.version_spans] for s in inflight]
    assert spans == [[(before, 0, len(s.token_ids))] for s in inflight], spans
    assert gap(sample_gaps(old, prompt, inflight)) < tol < gap(sample_gaps(new, prompt, inflight))  # told apart
    finishes = {s.finish_reason for s in inflight}
    assert finishes == ({FinishReason.ABORT} if mode is PauseMode.ABORT else {FinishReason.LENGTH}), finishes
    # Requests from now on sample from the new adapter, as the new version.
    after = await engine.generate(prompt, SamplingConfig(n=2, max_tokens=24, seed=4), f"after-{mode.value}")
    assert all(s.version_spans[0].version == before + 1 for s in after)
    assert gap(sample_gaps(new, prompt, after)) < tol
    ids = prompt + after[0].token_ids
    scored = (await engine.score(ids))[engine.name]
    assert gap([abs(a - b) for a, b in zip(scored, policy_logprobs(new, ids), strict=True)]) < tol


async def three_modes(engine: Any, models: list[torch.nn.Module], prompt: tuple[int, ...], tol: float,
                      gap: Callable[[list[float]], float] = max) -> None:
    """``models[0]``'s adapter, then three swaps (keep, abort, wait); afterwards the engine holds the last adapter
    alone: the replaced ones went once no request held them. An in-process engine takes every adapter from memory
    (no directory is ever written); a server's port keeps the directory of the adapter it serves, and only that."""
    written = _staging_dirs_written()
    await WeightSync(engine, VersionClock(engine.version), SyncConfig()).publish(adapter_source(models[0]))
    for mode, (old, new) in zip((PauseMode.KEEP, PauseMode.ABORT, PauseMode.WAIT), zip(models, models[1:])):
        await swap_across_requests(engine, mode, old, new, prompt, tol, gap)
    # Replaced adapters are removed at the next publication that finds them unheld. A server's request may still
    # count as held there (its client sees the end after the pause), so one more publication, with nothing in
    # flight, finds them all unheld.
    await WeightSync(engine, VersionClock(engine.version), SyncConfig()).publish(adapter_source(models[-1]))
    port = engine._adapters._port
    if isinstance(port, RemoteAdapterPort):
        assert list(port._dirs) == [engine._adapters.current]
        assert len(written()) == 1 and next(iter(written())) == port._dirs[engine._adapters.current].path
    else:
        assert written() == set()
    assert engine._adapters._registered() == 1


def _staging_dirs_written() -> Callable[[], set[Path]]:
    """The staging directories that exist now and did not before this call, whenever asked."""
    root = staging_root()
    before = set(root.glob(f"{STAGING_PREFIX}*"))
    return lambda: set(root.glob(f"{STAGING_PREFIX}*")) - before
