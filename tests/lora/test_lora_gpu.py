"""Adapter-only publication into the in-process engine on a CUDA GPU (vLLM 0.26 there), in bfloat16, in every
pause mode. Deselected by default; run through the device tool:

    source .gpu/setup.sh && python3 -m pytest -m gpu tests/lora/test_lora_gpu.py
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

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
