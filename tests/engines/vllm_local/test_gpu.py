"""The in-process engine on a CUDA GPU (vLLM 0.26+). Deselected by default; run through the device tool:

    source .gpu/setup.sh && python3 -m pytest -m gpu tests/engines/vllm_local/test_gpu.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.engines.updates import InMemory
from asyncrl.algorithms.logprobs import completion_logprobs
from asyncrl.config import SamplingConfig
from asyncrl.engines.protocols import StagedInEngine, WeightUpdate, WeightUpdateError
from asyncrl.engines.weights import StagedWeights, state_dict_for_engine
from asyncrl.types import FinishReason, PauseMode
from tests.support import load_paused, perturb
from tests.support.vllm_engine import _first_token_seen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_MEAN_ATOL = 0.05  # mean |engine - transformers| log-prob in bfloat16


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory) -> Path:
    from asyncrl.testing.tasks import arithmetic
    from asyncrl.testing.tiny import TinyModelSpec, build_tiny

    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=128, dtype="bfloat16")
    return build_tiny(tmp_path_factory.mktemp("gpu-model"), arithmetic.corpus(), spec)


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()


def _mean_diff(model, prompt, samples) -> float:
    with torch.no_grad():
        ref = completion_logprobs(model, [prompt] * len(samples), [s.token_ids for s in samples])
    diffs = [(ref.logprobs[i, : len(s.token_ids)].float().cpu() - torch.tensor(s.logprobs)).abs().mean()
             for i, s in enumerate(samples)]
    return float(torch.stack(diffs).mean())


@pytest.mark.parametrize("transfer", ["cuda_ipc", "files"])
async def test_gpu_engine_pause_modes_sync_and_parity(gpu_model_dir, transfer):
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    engine = await VLLMEngine.start(VLLMEngineConfig(model=str(gpu_model_dir), dtype="bfloat16", max_model_len=256,
                                                     max_num_seqs=16, kv_cache_gib=1.0, weight_transfer=transfer))
    try:
        prompt = (5, 6, 7, 8)
        params = SamplingConfig(n=4, max_tokens=16, ignore_eos=True)
        learner = _hf(gpu_model_dir)
        base = await engine.generate(prompt, params, "base")
        assert _mean_diff(learner, prompt, base) < BF16_MEAN_ATOL
        perturb(learner, seed=0)
        assert _mean_diff(learner, prompt, await engine.generate(prompt, params, "stale")) > 3 * BF16_MEAN_ATOL
        await _keep_sync_then_abort(engine, learner, prompt, params, transfer)
        await _bad_updates_refused(engine, learner, prompt, params, transfer)
        await _syncs_leave_no_memory(engine, state_dict_for_engine(learner))
    finally:
        await engine.close()


async def _keep_sync_then_abort(engine, learner, prompt, params, transfer) -> None:
    """A KEEP-mode sync mid-generation finishes the request on the new version; an ABORT pause cuts one."""
    long = SamplingConfig(n=2, max_tokens=200, ignore_eos=True)
    task = asyncio.create_task(engine.generate(prompt, long, "keep"))
    await _first_token_seen(engine)
    update = await engine.prepare(WeightUpdate(1, InMemory(state_dict_for_engine(learner))))
    assert isinstance(update.staged, StagedInEngine if transfer == "cuda_ipc" else StagedWeights)
    await load_paused(engine, update)
    kept = await task
    assert all(s.finish_reason is FinishReason.LENGTH and len(s.token_ids) == 200 for s in kept)
    assert all(s.newest_version == 1 for s in kept)

    fresh = await engine.generate(prompt, params, "fresh")
    assert _mean_diff(learner, prompt, fresh) < BF16_MEAN_ATOL, "after sync the engine matches the learner"
    assert all(s.oldest_version == 1 for s in fresh)

    cut = asyncio.create_task(engine.generate(prompt, long, "abort"))
    await _first_token_seen(engine)
    await engine.pause(PauseMode.ABORT, clear_cache=True)
    await engine.resume()
    assert all(s.finish_reason is FinishReason.ABORT and len(s.token_ids) < 200 for s in await cut)


async def _bad_updates_refused(engine, learner, prompt, params, transfer) -> None:
    """Bad updates are refused before the pause with the live weights and version untouched."""
    good = state_dict_for_engine(learner)
    name = next(iter(good))
    nan = dict(good, **{name: torch.full_like(good[name], float("nan"))})
    with pytest.raises(WeightUpdateError, match="NaN"):
        await engine.prepare(WeightUpdate(2, InMemory(nan)))
    with pytest.raises(WeightUpdateError, match="shape"):
        await engine.prepare(WeightUpdate(2, InMemory(dict(good, **{name: good[name][:1]}))))
    assert engine.version == 1
    # A staged version other than the one committed is refused without touching the weights.
    if transfer == "cuda_ipc":
        await engine.prepare(WeightUpdate(3, InMemory(good)))
        with pytest.raises(WeightUpdateError):
            await engine.load(WeightUpdate(4, InMemory(good), staged=StagedInEngine(4)))
        assert engine.version == 1
    after = await engine.generate(prompt, params, "after-refusals")
    assert _mean_diff(learner, prompt, after) < BF16_MEAN_ATOL


async def _syncs_leave_no_memory(engine, good) -> None:
    """Repeated syncs leave no GPU memory behind in the learner's process (the IPC snapshot is freed)."""
    nbytes = sum(t.numel() * 2 for t in good.values())  # one bfloat16 snapshot
    base = torch.cuda.memory_allocated()
    for version in range(5, 8):
        await load_paused(engine, await engine.prepare(WeightUpdate(version, InMemory(good))))
    assert engine.version == 7 and torch.cuda.memory_allocated() - base < nbytes


@pytest.mark.parametrize("level,eager", [(1, True), (2, False)])
async def test_gpu_sleep_frees_memory_and_wakes_with_the_update(gpu_model_dir, level, eager):
    """Sleep at ``level`` (level 2 with CUDA graphs, which must survive the wake: same addresses), publish
    through WeightSync (wake weights -> load -> wake KV cache), then the engine matches the learner. Prints
    ``SLEEP_RESULT {...}`` (memory freed, sleep and wake times); ``ASYNCRL_GPU_RESULTS=DIR`` also keeps it as
    ``DIR/sleep_level{level}.json``."""
    import dataclasses
    import time

    from asyncrl import SyncConfig, VersionClock, WeightSync
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    kv_gib = 2.0
    cfg = VLLMEngineConfig(model=str(gpu_model_dir), dtype="bfloat16", max_model_len=256, max_num_seqs=16,
                           kv_cache_gib=kv_gib, sleep=level, enforce_eager=eager, torch_compile=False,
                           cudagraph_capture_sizes=(1, 2, 4, 8, 16))
    engine = await VLLMEngine.start(cfg)
    try:
        prompt, params = (5, 6, 7, 8), SamplingConfig(n=4, max_tokens=16, ignore_eos=True)
        learner = _hf(gpu_model_dir)
        assert _mean_diff(learner, prompt, await engine.generate(prompt, params, "base")) < BF16_MEAN_ATOL
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        await engine.sleep()
        sleep_s = time.perf_counter() - t0
        freed = torch.cuda.mem_get_info()[0] - free0
        assert freed > 0.9 * kv_gib * 2**30, f"sleep freed only {freed / 2**30:.2f} GiB"
        perturb(learner, seed=0)
        sync = WeightSync(engine, VersionClock(engine.version), SyncConfig(mode=PauseMode.KEEP))
        t1 = time.perf_counter()
        timing = await sync.publish(state_dict_for_engine(learner))
        wake_update_s = time.perf_counter() - t1
        assert not engine.asleep and engine.version == timing.version
        fresh = await engine.generate(prompt, params, "woken")
        assert _mean_diff(learner, prompt, fresh) < BF16_MEAN_ATOL, "after wake + update the engine matches"
        assert all(s.oldest_version == timing.version for s in fresh)
        wake_s = await _sleep_and_wake_again(engine, sync, learner, level)
        after = await engine.generate(prompt, params, "woken-again")
        assert _mean_diff(learner, prompt, after) < BF16_MEAN_ATOL
        _report_sleep({"level": level, "enforce_eager": eager, "kv_cache_gib": kv_gib, "freed_gib": freed / 2**30,
                       "sleep_s": sleep_s, "wake_and_update_s": wake_update_s, "update_paused_s": timing.total_s,
                       "second_wake_s": wake_s, "counters": dataclasses.asdict(engine.sleep_counters)})
    finally:
        await engine.close()


async def _sleep_and_wake_again(engine, sync, learner, level: int) -> float:
    """Level 1 kept a host copy of the weights, so it wakes without an update; level 2 kept nothing, so only an
    update wakes it. Returns the seconds the wake took."""
    import time

    await engine.sleep()
    t0 = time.perf_counter()
    if level == 1:
        await engine.wake()
    else:
        with pytest.raises(WeightUpdateError, match="level 2"):
            await engine.wake()
        await sync.publish(state_dict_for_engine(learner))
    return time.perf_counter() - t0


def _report_sleep(result: dict) -> None:
    import json
    import os

    print("SLEEP_RESULT", json.dumps(result), flush=True)
    if os.environ.get("ASYNCRL_GPU_RESULTS"):
        out = Path(os.environ["ASYNCRL_GPU_RESULTS"]) / f"sleep_level{result['level']}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
