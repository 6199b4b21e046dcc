"""The one config mechanism (``asyncrl.config_base``): every config class is built by it, documents every
field, refuses a bad value with a ``ConfigError`` naming ``Class.field``, takes its choices as Enums or their
string values, and reads neither the disk nor the environment when it is constructed."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import pickle
from pathlib import Path

import pytest

import asyncrl.agents.endpoint
import asyncrl.agents.runner
import asyncrl.algorithms.losses
import asyncrl.checkpoint.store
import asyncrl.distributed.ranks
import asyncrl.engines.pool
import asyncrl.engines.lora.transport
import asyncrl.engines.vllm_local.config
import asyncrl.engines.vllm_remote.config
import asyncrl.engines.vllm_remote.nccl
import asyncrl.launch.layout
import asyncrl.lora.config
import asyncrl.preference.losses
import asyncrl.queues.ingest_server
from asyncrl.algorithms.losses import GRPOLoss, LossConfig
from asyncrl.config import (
    Autocast, EpisodeConfig, LearnerConfig, ProducerConfig, QueueConfig, SamplingConfig, SyncConfig,
    describe,
)
from asyncrl.config_base import config_classes
from asyncrl.errors import ConfigError

# One bad value per config class, and the field it must name. A class missing here fails the walk below.
BAD: dict[str, tuple[dict[str, object], str]] = {
    "SamplingConfig": ({"n": 0}, "n"),
    "EpisodeConfig": ({"env_timeout_s": float("inf")}, "env_timeout_s"),
    "ProducerConfig": ({"max_resubmits": -1}, "max_resubmits"),
    "QueueConfig": ({"capacity": True}, "capacity"),
    "SyncConfig": ({"overlap": "yes"}, "overlap"),
    "LearnerConfig": ({"autocast": "int8"}, "autocast"),
    "PipelineConfig": ({"shutdown_timeout_s": 0}, "shutdown_timeout_s"),
    "LossConfig": ({"length_norm": "mean"}, "length_norm"),
    "LoraConfig": ({"rank": 0}, "rank"),
    "LoraServingConfig": ({"max_rank": 4}, "max_rank"),
    "PreferenceConfig": ({"loss_type": "hinge"}, "loss_type"),
    "EndpointConfig": ({"token": "t", "port": 70000}, "port"),
    "AgentConfig": ({"timeout_s": 0}, "timeout_s"),
    "VLLMEngineConfig": ({"model": "m", "weight_transfer": "pigeon"}, "weight_transfer"),
    "RemoteEngineConfig": ({"base_url": "http://h:1", "model": "m", "model_dir": "d", "health_failures": 0},
                           "health_failures"),
    "NcclTransportConfig": ({"master_port": 1, "device": "cpu"}, "device"),
    "CheckpointConfig": ({"dir": "d", "keep": 0}, "keep"),
    "RolloutLogConfig": ({"dir": "d", "max_bytes": 1024}, "max_bytes"),
    "IngestServerConfig": ({"token": "t", "port": 70000}, "port"),
    "Layout": ({"strategy": "ANYWHERE"}, "strategy"),
    "PoolConfig": ({"drop_dead": 1}, "drop_dead"),
    "RankConfig": ({"control_timeout_s": -1}, "control_timeout_s"),
}
REQUIRED: dict[str, dict[str, object]] = {  # the fields without defaults, for building a good instance
    "VLLMEngineConfig": {"model": "m"},
    "RemoteEngineConfig": {"base_url": "http://h:1", "model": "m", "model_dir": "d"},
    "NcclTransportConfig": {"master_port": 1},
    "CheckpointConfig": {"dir": "d"},
    "RolloutLogConfig": {"dir": "d"},
    "IngestServerConfig": {"token": "t"},
    "EndpointConfig": {"token": "t"},
}
MODULES = (asyncrl.agents.endpoint, asyncrl.agents.runner,
           asyncrl.algorithms.losses, asyncrl.checkpoint.store, asyncrl.distributed.ranks, asyncrl.engines.pool,
           asyncrl.engines.vllm_local.config, asyncrl.engines.vllm_remote.config, asyncrl.engines.vllm_remote.nccl,
           asyncrl.engines.lora.transport, asyncrl.launch.layout, asyncrl.lora.config,
           asyncrl.preference.losses, asyncrl.queues.ingest_server)  # imported so every class is registered


def _classes() -> dict[str, type]:
    return {cls.__name__: cls for cls in config_classes()}


def test_every_config_class_uses_the_mechanism() -> None:
    assert sorted(_classes()) == sorted(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_class_refuses_a_bad_value_naming_the_field(name: str) -> None:
    kwargs, field = BAD[name]
    with pytest.raises(ConfigError) as err:
        _classes()[name](**kwargs)
    assert err.value.field == f"{name}.{field}" and str(err.value).startswith(f"{name}.{field}: ")


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_field_has_a_description_and_the_instance_is_frozen(name: str) -> None:
    cls = _classes()[name]
    for field_name, info in cls.__pydantic_fields__.items():  # type: ignore[attr-defined]
        assert info.description and len(info.description) > 10, f"{name}.{field_name} has no description"
    obj = cls(**REQUIRED.get(name, {}))
    first = dataclasses.fields(obj)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, first, getattr(obj, first))
    assert pickle.loads(pickle.dumps(obj)) == obj


def test_enums_accept_their_string_values() -> None:
    enums: dict[type, tuple[str, str]] = {LearnerConfig: ("autocast", "bfloat16"), SyncConfig: ("mode", "abort"),
                                          ProducerConfig: ("on_abort", "drop"), LossConfig: ("estimator", "rloo")}
    enums[LossConfig] = ("is_level", "sequence")
    for cls, (field, text) in enums.items():
        value = getattr(cls(**{field: text}), field)
        assert isinstance(value, enum.Enum) and value.value == text
    assert LearnerConfig(autocast="float16").autocast is Autocast.FLOAT16
    assert describe(LearnerConfig(autocast="bfloat16"))["autocast"] == "bfloat16"


def test_positional_construction_replace_and_nested_errors() -> None:
    assert SamplingConfig(4, 32).max_tokens == 32
    with pytest.raises(ConfigError) as err:
        SamplingConfig(4, 0)
    assert err.value.field == "SamplingConfig.max_tokens"
    cfg = dataclasses.replace(QueueConfig(), capacity=8)
    assert cfg.capacity == 8
    with pytest.raises(ConfigError, match="QueueConfig.capacity"):
        dataclasses.replace(cfg, capacity=0)  # a copy is validated again
    with pytest.raises(ConfigError) as err:
        ProducerConfig(episode={"max_turns": 0})  # type: ignore[arg-type]
    assert err.value.field == "ProducerConfig.episode.max_turns"
    with pytest.raises(ConfigError, match="EpisodeConfig.colour: is not a EpisodeConfig field"):
        EpisodeConfig(colour=1)  # type: ignore[call-arg]


def test_the_loss_takes_temperature_and_token_budget_from_sampling() -> None:
    for moved in ("temperature", "max_tokens"):
        with pytest.raises(ConfigError) as err:
            LossConfig(**{moved: 1})  # type: ignore[arg-type]
        assert err.value.field == f"LossConfig.{moved}"
    sampling = SamplingConfig(temperature=0.7, max_tokens=12)
    assert GRPOLoss(LossConfig(), sampling=sampling).sampling is sampling
    with pytest.raises(ConfigError, match="GRPOLoss.sampling"):
        GRPOLoss(LossConfig(length_norm="dr_grpo"))


def test_construction_reads_neither_disk_nor_environment(tmp_path: Path, tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl.engines.vllm_local.config import VLLMEngineConfig, engine_args, engine_env
    from asyncrl.engines.vllm_remote import RemoteEngineConfig, RemoteVLLMEngine

    missing = str(tmp_path / "missing")
    VLLMEngineConfig(model=missing)  # checked when the engine starts
    remote = RemoteEngineConfig(base_url="http://127.0.0.1:1", model="m", model_dir=missing)
    with pytest.raises(ConfigError, match="RemoteEngineConfig.model_dir") as err:
        asyncio.run(RemoteVLLMEngine.connect(remote))
    assert missing in str(err.value)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = VLLMEngineConfig(model=str(tiny_model_dir), kv_cache_gib=2.5)
    engine_args(cfg)
    assert "VLLM_CPU_KVCACHE_SPACE" not in os.environ  # building the arguments sets nothing
    assert engine_env(cfg) == {"VLLM_CPU_KVCACHE_SPACE": "3"}  # vLLM CPU here; conftest sets VLLM_LOGGING_LEVEL
    user = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    assert engine_env(cfg, user) == {}  # the user's settings win


def test_scoped_env_puts_back_what_was_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl.engines.vllm_local.config import scoped_env

    monkeypatch.setenv("ASYNCRL_TEST_KEEP", "old")
    monkeypatch.delenv("ASYNCRL_TEST_NEW", raising=False)
    with scoped_env({"ASYNCRL_TEST_KEEP": "new", "ASYNCRL_TEST_NEW": "1"}):
        assert os.environ["ASYNCRL_TEST_KEEP"] == "new" and os.environ["ASYNCRL_TEST_NEW"] == "1"
    assert os.environ["ASYNCRL_TEST_KEEP"] == "old" and "ASYNCRL_TEST_NEW" not in os.environ
