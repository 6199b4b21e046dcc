"""Shared by the tests of the in-process vLLM engine (not fixtures): a prompt, a probe that returns once the engine
generates, a publication by hand, and the gap between the engine's log-probs and a transformers model's."""

from __future__ import annotations

import torch

from asyncrl import VersionClock, WeightSync
from asyncrl.algorithms.logprobs import completion_logprobs
from asyncrl.config import SyncConfig
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.types import PauseMode

PARITY_ATOL = 2e-3  # float32 engine vs float32 transformers forward; seen ~1e-5


def _prompt(tokenizer, text: str = "12+34=") -> tuple[int, ...]:
    return tuple(tokenizer(text).input_ids)


async def _first_token_seen(engine) -> None:
    """Returns once the engine has produced a token for a probe request submitted now.

    Requests submitted before the probe are scheduled no later than it, so they are generating too.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.DELTA)
    async for _ in engine.llm.generate({"prompt_token_ids": [5, 6, 7]}, sp, request_id=f"probe-{id(sp)}"):
        return


async def _publish(engine, model) -> int:
    """Pause, load ``model``'s weights as the next version, resume. Returns the new version."""
    timing = await WeightSync(engine, VersionClock(engine.version), SyncConfig(mode=PauseMode.KEEP)).publish(
        state_dict_for_engine(model))
    return timing.version


def _hf_logprobs(model, prompt, samples) -> list[torch.Tensor]:
    with torch.no_grad():
        out = completion_logprobs(model, [prompt] * len(samples), [s.token_ids for s in samples])
    return [out.logprobs[i, : len(s.token_ids)] for i, s in enumerate(samples)]


def _max_diff(model, prompt, samples) -> float:
    ref = _hf_logprobs(model, prompt, samples)
    return max(float((r - torch.tensor(s.logprobs)).abs().max()) for r, s in zip(ref, samples))
