"""vLLM on CPU cannot rewind a seeded request's random generator: a prompt split over two scheduler steps
(chunked prefill) kills the engine core ("CPU Generator does not use offset"). asyncrl seeds every request,
so on CPU it turns chunked prefill off, for the engine it runs and for the servers it starts. Both tests send
more seeded prompt tokens at once than one scheduler step takes, which split a prompt before the fix."""

from __future__ import annotations

import pytest

from asyncrl.config import SamplingConfig
from asyncrl.engines.vllm_local.config import is_cpu_platform
from tests.support import engine_config

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not is_cpu_platform(), reason="the trap is vLLM CPU's")]

BUDGET = 128  # tokens per scheduler step; the prompts below need several steps


def _prompts(tokenizer, count: int) -> list[tuple[int, ...]]:
    return [tuple(tokenizer(f"{i}+{i}=" * 6).input_ids) for i in range(count)]  # ~30-40 tokens each


@pytest.mark.asyncio(loop_scope="function")
async def test_the_in_process_engine_takes_more_seeded_prompts_than_one_step_holds(tiny_model_dir, tokenizer):
    import asyncio

    from asyncrl.engines.vllm_local import VLLMEngine

    cfg = engine_config(tiny_model_dir, max_model_len=BUDGET, extra={"max_num_batched_tokens": BUDGET})
    engine = await VLLMEngine.start(cfg, name="seeded-prefill")
    try:
        prompts = _prompts(tokenizer, 24)
        assert sum(map(len, prompts)) > 4 * BUDGET
        params = SamplingConfig(n=2, max_tokens=4, seed=7)
        groups = await asyncio.gather(*(engine.generate(p, params, request_id=f"s{i}")
                                         for i, p in enumerate(prompts)))
        assert [len(g) for g in groups] == [2] * len(prompts)
    finally:
        await engine.close()


def test_servers_started_on_cpu_schedule_whole_prompts() -> None:
    from asyncrl.engines.vllm_remote.process import server_args

    args = server_args("/m", 8000, ["--max-model-len", "64"])
    assert "--no-enable-chunked-prefill" in args
    assert args.index("--no-enable-chunked-prefill") < args.index("--max-model-len")  # a caller may override
