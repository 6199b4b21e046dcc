"""An engine that samples in FP8 (vLLM's online quantization of a bf16 checkpoint) takes the learner's bf16
weights on every transport and after a level-2 sleep, with its scales recomputed: it then samples exactly what an
FP8 engine started from those weights samples. Deselected by default; run through the device tool:

    source .gpu/setup.sh && python3 -m pytest -m gpu tests/engines/vllm_local/test_gpu_fp8.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from asyncrl.config import SamplingConfig
from asyncrl.engines.updates import InMemory
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.types import PauseMode
from tests.engines.vllm_local.test_gpu import _hf, _mean_diff, gpu_model_dir  # noqa: F401  (the fixture)
from tests.support import load_paused, perturb

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPT = (5, 6, 7, 8)
PARAMS = SamplingConfig(n=8, max_tokens=24, ignore_eos=True, seed=0)  # seeded per request: same draws per weights
SAME_LOGPROB_ATOL = 0.02  # mean |published - fresh| where both quantized the same bf16 weights


def _config(model: Path, transfer: str, sleep: int = 0):
    from asyncrl.engines.vllm_local import VLLMEngineConfig

    return VLLMEngineConfig(model=str(model), dtype="bfloat16", quantization="fp8", max_model_len=256,
                            max_num_seqs=16, kv_cache_gib=1.0, weight_transfer=transfer, sleep=sleep)


def _moved_checkpoint(base: Path, learner, out: Path) -> Path:
    """The learner's weights as a checkpoint beside the base's tokenizer: what a fresh engine starts from."""
    shutil.copytree(base, out)
    learner.save_pretrained(str(out), safe_serialization=True)
    return out


def _same(a, b) -> float:
    """Both engines drew the same tokens; the mean log-prob gap between them."""
    assert [s.token_ids for s in a] == [s.token_ids for s in b], "the published engine samples otherwise"
    return float(torch.stack([(torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().mean()
                              for x, y in zip(a, b)]).mean())


@pytest.mark.parametrize("transfer", ["cuda_ipc", "files"])
async def test_gpu_fp8_engine_takes_bf16_weights_with_fresh_scales(gpu_model_dir, tmp_path, transfer):  # noqa: F811
    from asyncrl import SyncConfig, VersionClock, WeightSync
    from asyncrl.engines.vllm_local import VLLMEngine

    learner = perturb(_hf(gpu_model_dir), seed=0)
    moved = _moved_checkpoint(gpu_model_dir, learner, tmp_path / "moved")
    fresh = await VLLMEngine.start(_config(moved, transfer))
    engine = await VLLMEngine.start(_config(gpu_model_dir, transfer, sleep=2))
    try:
        assert engine.behaviour_precision.quantization == "fp8" and engine.behaviour_precision.quantized
        want = await fresh.generate(PROMPT, PARAMS, "probe")
        fp8_error = _mean_diff(learner, PROMPT, want)  # what FP8 costs against the bf16 learner
        stale = await engine.generate(PROMPT, PARAMS, "probe")
        assert [s.token_ids for s in stale] != [s.token_ids for s in want], "the base weights are told apart"

        await load_paused(engine, await engine.prepare(_update(1, learner)))
        assert _same(await engine.generate(PROMPT, PARAMS, "probe"), want) < SAME_LOGPROB_ATOL

        # Level 2 discards the weights; only an update wakes the engine, and it must quantize them again.
        await engine.sleep()
        sync = WeightSync(engine, VersionClock(engine.version), SyncConfig(mode=PauseMode.KEEP))
        await sync.publish(state_dict_for_engine(learner))
        assert _same(await engine.generate(PROMPT, PARAMS, "probe"), want) < SAME_LOGPROB_ATOL
        print(f"FP8_RESULT transfer={transfer} fp8_vs_bf16_mean_abs_logprob={fp8_error:.4f}", flush=True)
    finally:
        await engine.close()
        await fresh.close()


def _update(version: int, learner):
    from asyncrl.engines.updates import WeightUpdate

    return WeightUpdate(version, InMemory(state_dict_for_engine(learner)))
