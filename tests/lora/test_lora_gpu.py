"""Adapter-only publication into the in-process engine on a CUDA GPU (vLLM 0.26 there), in bfloat16, in every
pause mode. Deselected by default; run through the device tool:

    source .gpu/setup.sh && python3 -m pytest -m gpu tests/lora/test_lora_gpu.py
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from asyncrl import SamplingConfig
from asyncrl.engines.lora.transport import LoraServingConfig
from tests.support.lora import peft_model, three_modes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_MEAN_ATOL = 0.05  # mean |engine - PEFT| log-prob per token in bfloat16


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory) -> Path:
    from asyncrl.testing.tasks import arithmetic
    from asyncrl.testing.tiny import TinyModelSpec, build_tiny

    spec = TinyModelSpec(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=128, dtype="bfloat16")
    return build_tiny(tmp_path_factory.mktemp("gpu-lora-model"), arithmetic.corpus(), spec)


async def test_gpu_adapter_publication_in_every_pause_mode(gpu_model_dir):
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    engine = await VLLMEngine.start(VLLMEngineConfig(model=str(gpu_model_dir), dtype="bfloat16", max_model_len=256,
                                                     max_num_seqs=16, kv_cache_gib=1.0,
                                                     lora=LoraServingConfig(max_rank=8)))
    try:
        models = [peft_model(gpu_model_dir, seed, torch.bfloat16, "cuda") for seed in (11, 12, 13, 14)]
        await three_modes(engine, models, (5, 6, 7, 8), BF16_MEAN_ATOL, statistics.fmean)
    finally:
        await engine.close()


async def test_gpu_policy_trains_on_the_engines_base(gpu_model_dir):
    """The frozen base held once: the policy maps the engine's weights (``lend_base``, ``share_base``), computes
    what a policy with its own copy computes, allocates no base of its own, trains its adapter without touching the
    engine's weights, and the engine serves each adapter it publishes."""
    import gc

    from asyncrl import publish
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig
    from asyncrl.lora import share_base
    from tests.support.lora import adapter_source, sample_gaps

    engine = await VLLMEngine.start(VLLMEngineConfig(model=str(gpu_model_dir), dtype="bfloat16", max_model_len=256,
                                                     max_num_seqs=16, kv_cache_gib=1.0,
                                                     lora=LoraServingConfig(max_rank=8)))
    try:
        own = peft_model(gpu_model_dir, 21, torch.bfloat16, "cpu").cuda()  # the same adapter (CPU RNG), own base
        policy = peft_model(gpu_model_dir, 21, torch.bfloat16, "cpu")
        base_bytes = sum(p.numel() * p.element_size() for p in policy.parameters() if not p.requires_grad)
        before = torch.cuda.memory_allocated()
        lent = await engine.lend_base()
        assert share_base(policy, lent) == base_bytes
        grown = torch.cuda.memory_allocated() - before
        assert grown < base_bytes / 4, f"the policy allocated {grown} bytes beside a {base_bytes}-byte base"
        ids = torch.tensor([[3, 17, 42, 5, 9, 11, 60, 2]], device="cuda")
        with torch.no_grad():
            torch.testing.assert_close(policy(ids).logits, own(ids).logits, rtol=0.0, atol=1e-2)
        prompt = tuple(ids[0].tolist())
        engine_weights = {n: t.clone() for n, t in lent.tensors.items()}
        for round_ in range(2):
            await publish(engine, adapter_source(policy))
            served = await engine.generate(prompt, SamplingConfig(n=4, max_tokens=8), f"shared-base-{round_}")
            assert statistics.fmean(sample_gaps(policy, prompt, served)) < BF16_MEAN_ATOL
            optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
            policy.train()
            policy(ids).logits.float().logsumexp(-1).sum().backward()
            optimizer.step()
            policy.eval()
        assert all(torch.equal(engine_weights[n], t) for n, t in lent.tensors.items()), "the engine's weights held"
        del policy, lent, own
        gc.collect()
        torch.cuda.ipc_collect()
    finally:
        await engine.close()
