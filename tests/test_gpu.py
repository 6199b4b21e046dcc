"""The in-process engine on a CUDA GPU (vLLM 0.26+). Deselected by default; run through the device tool:

    source .gpu/setup.sh && python3 -m pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms.logprobs import completion_logprobs
from asyncrl.config import SamplingConfig
from asyncrl.engines.protocols import StagedInEngine, WeightUpdate, WeightUpdateError
from asyncrl.engines.weights import StagedWeights, state_dict_for_engine
from asyncrl.types import FinishReason, PauseMode
from tests.support import apply_update
from tests.test_vllm_engine import _first_token_seen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_MEAN_ATOL = 0.05  # mean |engine - transformers| log-prob in bfloat16


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory) -> Path:
    from asyncrl.tasks import arithmetic
    from asyncrl.tiny import TinyModelSpec, build_tiny

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

        torch.manual_seed(0)
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        assert _mean_diff(learner, prompt, await engine.generate(prompt, params, "stale")) > 3 * BF16_MEAN_ATOL

        long = SamplingConfig(n=2, max_tokens=200, ignore_eos=True)
        task = asyncio.create_task(engine.generate(prompt, long, "keep"))
        await _first_token_seen(engine)
        update = await engine.prepare(WeightUpdate(1, state_dict_for_engine(learner)))
        assert isinstance(update.staged, StagedInEngine if transfer == "cuda_ipc" else StagedWeights)
        await engine.pause(PauseMode.KEEP, clear_cache=True)
        try:
            await engine.load(update)
        finally:
            await engine.resume()
            engine.release(update)
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
        assert all(s.finish_reason in (FinishReason.ABORT, FinishReason.LENGTH) for s in await cut)

        # Bad updates are refused before the pause with the live weights and version untouched.
        good = state_dict_for_engine(learner)
        name = next(iter(good))
        nan = dict(good, **{name: torch.full_like(good[name], float("nan"))})
        with pytest.raises(WeightUpdateError, match="NaN"):
            await engine.prepare(WeightUpdate(2, nan))
        with pytest.raises(WeightUpdateError, match="shape"):
            await engine.prepare(WeightUpdate(2, dict(good, **{name: good[name][:1]})))
        assert engine.version == 1
        # A staged version other than the one committed is refused without touching the weights.
        if transfer == "cuda_ipc":
            await engine.prepare(WeightUpdate(3, good))
            with pytest.raises(WeightUpdateError):
                await engine.load(WeightUpdate(4, good, staged=StagedInEngine(4)))
            assert engine.version == 1
        after = await engine.generate(prompt, params, "after-refusals")
        assert _mean_diff(learner, prompt, after) < BF16_MEAN_ATOL

        # Repeated syncs leave no GPU memory behind in the learner's process (the IPC snapshot is freed).
        nbytes = sum(t.numel() * 2 for t in good.values())  # one bfloat16 snapshot
        base = torch.cuda.memory_allocated()
        for version in range(5, 8):
            await engine.pause(PauseMode.KEEP, clear_cache=True)
            try:
                await apply_update(engine, WeightUpdate(version, good))
            finally:
                await engine.resume()
        assert engine.version == 7 and torch.cuda.memory_allocated() - base < nbytes
    finally:
        await engine.close()
