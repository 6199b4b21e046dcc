"""RemoteVLLMEngine and start_vllm_server against a real vLLM server on a tiny local model: generation,
multi-turn episodes, the pause modes, cancellation, weight sync and health probes (EnginePool is in
test_remote_engine_pool.py).

One server, ``server_a`` (conftest.py), is started for the whole module (~30 s on a 2-core machine).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from asyncrl.engines.updates import InMemory
from asyncrl.config import ConfigError, EpisodeConfig, ProducerConfig, SamplingConfig
from asyncrl.engines.protocols import Engine, PromptRejected, WeightUpdate, WeightUpdateError
from asyncrl.engines.vllm_remote import RemoteEngineConfig, RemoteVLLMEngine
from asyncrl.engines.vllm_remote import NcclTransportConfig
from asyncrl.engines.vllm_remote.process import ServerProcess, free_port, start_vllm_server
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.episodes import EpisodeRunner, StepResult, turn_slices
from asyncrl.types import FinishReason, PauseMode, Prompt, Sample
from tests.support.remote_engine import (
    MAX_MODEL_LEN, PROMPT, SEQS, SERVED_PRECISION, TOL, _cfg, _device_args, _hf_logprobs, _max_diff, _perturbed,
)
from tests.support import CpuBurners, apply_update

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
aio = pytest.mark.asyncio(loop_scope="module")

LONG = SamplingConfig(n=8, max_tokens=240, temperature=1.0, seed=7)  # most samples still run at a pause
# The pause tests need samples still running on the server when the pause lands. On a loaded 2-core machine
# the client can read a stream well behind the server; a round where every sample had already finished
# proves nothing and is run again.
ATTEMPTS = 5


# -- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(remote_model_dir: Path) -> Path:
    return remote_model_dir


@pytest_asyncio.fixture(loop_scope="module")
async def engine(server_a: ServerProcess, model_dir: Path) -> AsyncIterator[RemoteVLLMEngine]:
    eng = await RemoteVLLMEngine.connect(_cfg(server_a, model_dir), name="a")
    yield eng
    await eng.close()


# -- helpers -------------------------------------------------------------------------------------------------


async def _until(cond: Callable[[], bool], timeout_s: float = 30.0) -> None:
    # Progress of an external server has no event to await: check the condition every 10 ms up to a deadline.
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


def _flowing(engine: RemoteVLLMEngine, requests: int) -> Callable[[], bool]:
    """True once ``requests`` streams are open and each has received at least 2 tokens."""
    def cond() -> bool:
        counts = engine.inflight()
        return len(counts) >= requests and min(counts.values()) >= 2
    return cond


async def _until_flowing(engine: RemoteVLLMEngine, task: asyncio.Task, requests: int = 4) -> bool:
    """Wait until ``requests`` of ``task``'s streams flow (True), or until ``task`` ends first (False): a
    generation that finished between two checks, or failed (its error is raised here, not a timeout)."""
    flowing = _flowing(engine, requests)
    await _until(lambda: task.done() or flowing())
    if task.done():
        task.result()
        return False
    return True


def _check_sample(s: Sample) -> None:
    assert len(s.token_ids) == len(s.logprobs)
    assert all(lp <= 0.0 for lp in s.logprobs)
    assert all(0 <= t < 128 for t in s.token_ids)
    if s.token_ids:  # spans cover every token, in order
        assert s.version_spans[0].start == 0 and s.version_spans[-1].end == len(s.token_ids)
        assert all(a.end == b.start for a, b in zip(s.version_spans, s.version_spans[1:]))


# -- config ------------------------------------------------------------------------------------------------


def test_config_errors_name_the_field(model_dir: Path, tmp_path: Path) -> None:
    good = dict(base_url="http://127.0.0.1:1", model="m", model_dir=str(model_dir))
    cases = {"base_url": "localhost:8000", "model": "", "request_timeout_s": 0,
             "health_timeout_s": float("nan"), "health_check_interval_s": -1, "api_key": ""}
    for field, bad in cases.items():
        with pytest.raises(ConfigError) as err:
            RemoteEngineConfig(**{**good, field: bad})  # type: ignore[arg-type]
        assert err.value.field == f"RemoteEngineConfig.{field}"
    # Directories are values at construction and checked where the engine connects, before any request.
    for field, bad in {"model_dir": str(tmp_path), "staging_dir": str(tmp_path / "missing")}.items():
        with pytest.raises(ConfigError) as err:
            asyncio.run(RemoteVLLMEngine.connect(RemoteEngineConfig(**{**good, field: bad})))  # type: ignore[arg-type]
        assert err.value.field == f"RemoteEngineConfig.{field}"
    assert RemoteEngineConfig(**{**good, "base_url": "http://h:1/"}).base_url == "http://h:1"  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="master_port"):
        NcclTransportConfig(master_port=0)


# -- one server --------------------------------------------------------------------------------------------


@aio
async def test_the_declared_precision_is_what_the_pipeline_pairs_with_the_learner(server_a: ServerProcess,
                                                                                 model_dir: Path,
                                                                                 hf_model: torch.nn.Module) -> None:
    """A server says nothing of its numerics: undeclared, nothing is checked; declared as it was started
    (``server_precision_args``), a learner in another plain dtype is refused and one in the same is accepted."""
    from asyncrl.config import PipelineConfig
    from asyncrl.recipes import check_engine_fits

    bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    undeclared = await RemoteVLLMEngine.connect(_cfg(server_a, model_dir), name="undeclared")
    declared = await RemoteVLLMEngine.connect(_cfg(server_a, model_dir, precision=SERVED_PRECISION), name="declared")
    try:
        assert undeclared.behaviour_precision is None and check_engine_fits(undeclared, bf16, PipelineConfig()) is None
        assert declared.behaviour_precision == SERVED_PRECISION
        with pytest.raises(ConfigError, match="allow_dtype_mismatch"):
            check_engine_fits(declared, bf16, PipelineConfig())
        check_engine_fits(declared, hf_model, PipelineConfig())
        # Declared in a config file's terms (a mapping), as a TOML or JSON run configuration gives it.
        assert RemoteEngineConfig(base_url=server_a.base_url, model="m", model_dir=str(model_dir),
                                  precision={"dtype": "bfloat16", "quantization": "fp8"}).precision.quantized
    finally:
        await undeclared.close()
        await declared.close()



@aio
async def test_generate_logprobs_and_token_ids(engine: RemoteVLLMEngine, hf_model: torch.nn.Module) -> None:
    assert isinstance(engine, Engine) and engine.version == 0 and engine.max_model_len == MAX_MODEL_LEN
    await engine.check_alive()
    params = SamplingConfig(n=4, max_tokens=12, temperature=1.0, seed=3)
    samples = await engine.generate(PROMPT, params, "gen")
    assert len(samples) == 4
    for s in samples:
        _check_sample(s)
        assert s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and len(s.token_ids) > 0
        assert [(v.version, v.start, v.end) for v in s.version_spans] == [(0, 0, len(s.token_ids))]
        # Behaviour log-probs are the model's own at temperature 1.
        hf = _hf_logprobs(hf_model, list(PROMPT) + list(s.token_ids))[-len(s.token_ids):]
        assert _max_diff(list(s.logprobs), hf) < TOL
    # Seeds derive from the run seed and the request id: the same request replays, another one differs.
    again = await engine.generate(PROMPT, params, "gen")
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]
    other = await engine.generate(PROMPT, params, "gen-other")
    assert [s.token_ids for s in other] != [s.token_ids for s in samples]
    with pytest.raises(PromptRejected):
        await engine.generate((), params, "empty")
    with pytest.raises(PromptRejected):
        await engine.generate(tuple(i % 90 + 3 for i in range(MAX_MODEL_LEN)), params, "too-long")


class _Recorder:
    """A Sampler in front of ``engine`` that keeps the context of every call."""

    def __init__(self, engine: RemoteVLLMEngine) -> None:
        self.engine, self.name, self.contexts = engine, engine.name, {}

    version = property(lambda self: self.engine.version)
    max_model_len = property(lambda self: self.engine.max_model_len)
    vocab_size = property(lambda self: self.engine.vocab_size)

    async def generate(self, prompt_ids, params, request_id, n=None):  # type: ignore[no-untyped-def]
        self.contexts[request_id] = prompt_ids
        return await self.engine.generate(prompt_ids, params, request_id, n)


@aio
async def test_multi_turn_episodes_send_ids_and_match_learner_logprobs(engine: RemoteVLLMEngine,
                                                                       hf_model: torch.nn.Module) -> None:
    """Every turn is a completion request whose prompt is the token ids so far (no text), and the trajectory's
    model tokens carry the server's behaviour log-probs, which the learner reproduces in context."""
    class Env:
        steps = 0

        async def step(self, turn: Sample) -> StepResult:
            self.steps += 1
            return StepResult((20, 21, 22), done=self.steps == 3)

        async def close(self) -> None:
            pass

    recorder = _Recorder(engine)
    cfg = ProducerConfig(sampling=SamplingConfig(n=2, max_tokens=10, seed=3, ignore_eos=True),
                         episode=EpisodeConfig(max_turns=3))
    episodes = await EpisodeRunner(recorder, lambda prompt: Env(), cfg).run_group("mt", Prompt("p", PROMPT))
    for i, episode in enumerate(episodes):
        t = episode.trajectory
        assert t.loss_mask == (1,) * 10 + (0,) * 3 + (1,) * 10 + (0,) * 3 + (1,) * 10 + (0,) * 3
        starts = [a for a, _ in turn_slices(t)]
        assert [recorder.contexts[f"mt/e{i}/t{k}"] for k in range(3)] == [PROMPT + t.token_ids[:a] for a in starts]
        hf = _hf_logprobs(hf_model, list(PROMPT + t.token_ids))[len(PROMPT) - 1:]
        model = [(lp, want) for lp, want, m in zip(t.logprobs, hf, t.loss_mask, strict=True) if m]
        assert _max_diff(*map(list, zip(*model))) < TOL
    stopped = await engine.generate(PROMPT, SamplingConfig(n=2, max_tokens=8, stop_token_ids=tuple(range(128))), "stop")
    assert all(s.finish_reason is FinishReason.STOP and len(s.token_ids) == 1 for s in stopped)


@aio
async def test_pause_abort_cuts_samples(engine: RemoteVLLMEngine) -> None:
    for attempt in range(ATTEMPTS):
        task = asyncio.create_task(engine.generate(PROMPT, LONG, f"abort{attempt}"))
        if not await _until_flowing(engine, task):
            continue  # done before the pause could cut anything: another attempt
        await engine.pause(PauseMode.ABORT, clear_cache=True)
        try:
            samples = await asyncio.wait_for(task, 10)  # cut requests return while the server is paused
        finally:
            await engine.resume()
        for s in samples:
            _check_sample(s)
        cut = [s for s in samples if s.finish_reason is FinishReason.ABORT]
        assert all(0 < len(s.token_ids) < LONG.max_tokens for s in cut)
        assert engine.metrics()["engine/inflight_requests"] == 0
        if cut:
            return
    pytest.fail(f"no sample was in flight at the pause in {ATTEMPTS} attempts")


@aio
async def test_pause_keep_freezes_then_continues_with_split_spans(engine: RemoteVLLMEngine,
                                                                  model_dir: Path) -> None:
    from safetensors.torch import load_file

    base = load_file(str(model_dir / "model.safetensors"))
    for attempt in range(ATTEMPTS):
        if await _keep_pause_round(engine, base, f"keep{attempt}"):
            return
    pytest.fail(f"no sample continued after the pause in {ATTEMPTS} attempts")


async def _keep_pause_round(engine: RemoteVLLMEngine, base: dict[str, torch.Tensor], request_id: str) -> bool:
    """One keep pause with a version bump (same weights) inside it; True if some sample ran across it."""
    old = engine.version
    task = asyncio.create_task(engine.generate(PROMPT, LONG, request_id))
    if not await _until_flowing(engine, task):
        return False  # done before the pause: nothing could run across it
    await engine.pause(PauseMode.KEEP, clear_cache=True)
    try:
        await asyncio.sleep(1.0)  # anything sampled before the pause has arrived by now
        frozen = engine.inflight()
        await asyncio.sleep(1.0)
        assert engine.inflight() == frozen, "tokens arrived while paused"
        await apply_update(engine, WeightUpdate(old + 1, InMemory(base)))  # same weights, new version
    finally:
        await engine.resume()
    samples = await asyncio.wait_for(task, 60)
    split = 0
    for i, s in enumerate(samples):
        _check_sample(s)
        assert s.finish_reason is not FinishReason.ABORT
        at_pause = frozen.get(f"{request_id}-{i}")
        if at_pause is not None and len(s.token_ids) > at_pause:
            split += 1
            want = [(old, 0, at_pause), (old + 1, at_pause, len(s.token_ids))]
            assert [(v.version, v.start, v.end) for v in s.version_spans] == [w for w in want if w[2] > w[1]]
        else:
            assert {v.version for v in s.version_spans} <= {old, old + 1} and len(s.version_spans) == 1
    return split > 0


@aio
async def test_pause_wait_drains_and_holds_new_requests(engine: RemoteVLLMEngine) -> None:
    task = asyncio.create_task(engine.generate(PROMPT, LONG, "wait"))
    await _until_flowing(engine, task)
    await engine.pause(PauseMode.WAIT, clear_cache=True)
    try:
        samples = await asyncio.wait_for(task, 10)  # drained before the pause returned
        assert all(s.finish_reason is not FinishReason.ABORT for s in samples)
        late = asyncio.create_task(engine.generate(PROMPT, SamplingConfig(n=1, max_tokens=4), "late"))
        done, _ = await asyncio.wait({late}, timeout=1.0)
        assert not done, "a request submitted while paused ran"
    finally:
        await engine.resume()
    (s,) = await asyncio.wait_for(late, 30)
    assert s.finish_reason is not FinishReason.ABORT and len(s.token_ids) > 0


@aio
async def test_cancel_aborts_on_server(engine: RemoteVLLMEngine) -> None:
    await engine.pause(PauseMode.KEEP, clear_cache=False)  # requests queue, frozen, on the server
    try:
        kept = asyncio.create_task(engine.generate(PROMPT, SamplingConfig(n=1, max_tokens=8), "kept"))
        cancelled = asyncio.create_task(engine.generate(PROMPT, SamplingConfig(n=1, max_tokens=8), "cancelled"))
        await _until(lambda: len(engine.inflight()) == 2)
        await asyncio.sleep(0.5)  # both requests have reached the server
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        # The server still tracks only the request we did not cancel (this call aborts it).
        out = await engine._api.post("/abort_requests", body={})
        assert out["aborted"] == 1
    finally:
        await engine.resume()
    (s,) = await asyncio.wait_for(kept, 30)
    assert s.finish_reason is FinishReason.ABORT and s.token_ids == ()


@aio
async def test_weight_sync_matches_learner_logprobs(engine: RemoteVLLMEngine, hf_model: torch.nn.Module) -> None:
    before = [await engine.prompt_logprobs(ids) for ids in SEQS]
    for ids, got in zip(SEQS, before, strict=True):
        assert _max_diff(got, _hf_logprobs(hf_model, ids)) < TOL  # server holds the base weights
    learner = _perturbed(hf_model, seed=1)
    want = [_hf_logprobs(learner, ids) for ids in SEQS]
    assert max(_max_diff(g, w) for g, w in zip(before, want, strict=True)) > 0.05

    await engine.pause(PauseMode.KEEP, clear_cache=True)
    try:
        await apply_update(engine, WeightUpdate(2, InMemory(state_dict_for_engine(learner))))
    finally:
        await engine.resume()
    assert engine.version == 2
    after = [await engine.prompt_logprobs(ids) for ids in SEQS]
    assert max(_max_diff(g, w) for g, w in zip(after, want, strict=True)) < TOL
    for s in await engine.generate(PROMPT, SamplingConfig(n=4, max_tokens=12, seed=5), "synced"):
        _check_sample(s)
        assert {v.version for v in s.version_spans} == {2}
        hf = _hf_logprobs(learner, list(PROMPT) + list(s.token_ids))[-len(s.token_ids):]
        assert _max_diff(list(s.logprobs), hf) < TOL

    # A wrong shape is refused before anything reaches the server: version and weights stay.
    bad = dict(state_dict_for_engine(hf_model))
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(WeightUpdateError, match="model.norm.weight"):
        await apply_update(engine, WeightUpdate(3, InMemory(bad)))
    assert engine.version == 2
    assert await engine.prompt_logprobs(SEQS[0]) == after[0]


# -- GPU: the NCCL weight transport (vLLM 0.26 on the lent H200s; needs two GPUs) ---------------------------


@pytest.mark.gpu
@aio
async def test_nccl_transport_publishes_weights(model_dir: Path, hf_model: torch.nn.Module) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL will not put the trainer and the server's worker on one device")
    args = ["--weight-transfer-config", '{"backend": "nccl"}', *_device_args()]
    # The server gets GPU 0, the trainer side (this process) broadcasts from cuda:1. NVLink multicast stays
    # off (the host's GPUs are shared).
    env = {"CUDA_VISIBLE_DEVICES": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    async with start_vllm_server(model_dir, free_port(), extra_args=args, env=env) as server:
        nccl = NcclTransportConfig(master_port=free_port(), device="cuda:1")
        engine = await RemoteVLLMEngine.connect(dataclasses.replace(_cfg(server, model_dir), nccl=nccl), name="gpu")
        try:
            for version, model in ((1, _perturbed(hf_model, seed=3)), (2, hf_model)):
                want = [_hf_logprobs(model, ids) for ids in SEQS]
                before = [await engine.prompt_logprobs(ids) for ids in SEQS]
                assert max(_max_diff(g, w) for g, w in zip(before, want, strict=True)) > 0.05
                tensors = {k: v.to("cuda:1") for k, v in state_dict_for_engine(model).items()}
                t0 = time.perf_counter()
                await engine.pause(PauseMode.KEEP, clear_cache=True)
                try:
                    t1 = time.perf_counter()
                    await apply_update(engine, WeightUpdate(version, InMemory(tensors)))
                    t2 = time.perf_counter()
                finally:
                    await engine.resume()
                mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
                print(f"NCCL sync v{version}: {mib:.1f} MiB, paused {time.perf_counter() - t0:.3f}s "
                      f"(pause {t1 - t0:.3f}s, transfer {t2 - t1:.3f}s)", flush=True)
                assert engine.version == version
                after = [await engine.prompt_logprobs(ids) for ids in SEQS]
                assert max(_max_diff(g, w) for g, w in zip(after, want, strict=True)) < TOL
                (s,) = await engine.generate(PROMPT, SamplingConfig(n=1, max_tokens=8, seed=1), f"g{version}")
                assert {v.version for v in s.version_spans} == {version}
        finally:
            await engine.close()


@aio
async def test_health_probes_hold_beside_cpu_burning_neighbours(engine: RemoteVLLMEngine) -> None:
    """Streams silent through a held pause are probed every second; with both cores busy a /health answer can
    be slow, which must not declare the server dead (it did, one slow answer at a time, on a loaded CI)."""
    with CpuBurners(2):
        for _ in range(5):
            await engine.check_alive()
        task = asyncio.create_task(engine.generate(PROMPT, LONG, request_id="burn"))
        if await _until_flowing(engine, task, requests=2):
            await engine.pause(PauseMode.KEEP, clear_cache=False)
            try:
                await asyncio.sleep(3.0)  # hold the pause: the silent streams are probed meanwhile
            finally:
                await engine.resume()
        samples = await asyncio.wait_for(task, 120)
    assert len(samples) == LONG.n and all(s.finish_reason is not FinishReason.ABORT for s in samples)
