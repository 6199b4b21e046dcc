"""The weight path declares what it carries: every source its kind and how it is held, every transport the kinds
it accepts, and an engine refuses an unsupported pairing before anything is staged, naming both kinds. The
real-engine refusals are in lora/test_lora_publication.py (``test_an_engine_refuses_what_it_cannot_serve``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.engines.embedded.client import RemoteControlEngine
from asyncrl.engines.lora.transport import AdapterTransport, LoraServingConfig
from asyncrl.engines.transports.base import check_carries
from asyncrl.engines.transports.files import FileTransport, stage_as_files
from asyncrl.engines.updates import (AdapterWeights, InMemory, ShardedBuckets, StagedDirectory, UpdateKind,
                                     WeightUpdate, as_source)
from asyncrl.engines.vllm_local.ipc import CudaIpcTransport
from asyncrl.engines.vllm_local.sleep import SleepControl, SleepTransport
from asyncrl.engines.vllm_remote.nccl import NcclTransport, NcclTransportConfig
from asyncrl.engines.weights import StagedTensors, all_finite, read_manifest, stage
from asyncrl.errors import WeightUpdateError
from asyncrl.lora.config import LoraConfig

WEIGHTS = {"layer.weight": torch.ones(4, 3), "layer.bias": torch.zeros(4)}


def _model_dir(tmp_path: Path) -> Path:
    out = tmp_path / "model"
    out.mkdir()
    save_file(WEIGHTS, str(out / "model.safetensors"))
    return out


def _full_transports(model_dir: Path, tmp_path: Path) -> list:  # type: ignore[type-arg]
    manifest = read_manifest(model_dir)

    async def never(*_: object) -> None:
        raise AssertionError("a refused update reached the engine")

    files = FileTransport("e", never, model_dir, torch.float32, root=tmp_path)
    control = SleepControl(sleep=never, wake_up=never, drain=never, rpc=never)
    return [files, CudaIpcTransport("e", never, manifest, torch.float32),
            NcclTransport("e", None, NcclTransportConfig(master_address="127.0.0.1", master_port=1), manifest),  # type: ignore[arg-type]
            SleepTransport("e", files, control, manifest, torch.float32)]


def test_every_source_declares_its_kind_and_how_it_is_held(tmp_path):
    staged = stage(WEIGHTS, torch.float32, tmp_path)
    try:
        in_files = [StagedDirectory(staged), ShardedBuckets(StagedTensors(staged))]
        for source in in_files:
            assert source.kind is UpdateKind.FULL and source.files is staged
            assert dict(source.file_specs) == dict(read_manifest(staged.path))
            assert set(source.tensors) == set(WEIGHTS) and source.adapter_config is None
        memory = InMemory(WEIGHTS)
        assert memory.kind is UpdateKind.FULL and memory.files is None and memory.file_specs is None
        adapter = AdapterWeights({"a": torch.ones(2)}, LoraConfig(rank=8))
        assert adapter.kind is UpdateKind.ADAPTER and adapter.files is None and adapter.adapter_config.rank == 8
        # A detached copy owns its tensors and keeps its kind (a staged source becomes tensors in memory).
        for source, kind in ((in_files[0], UpdateKind.FULL), (memory, UpdateKind.FULL), (adapter, UpdateKind.ADAPTER)):
            copy = source.detached()
            assert copy.kind is kind and copy.files is None
            assert all(torch.equal(copy.tensors[k], source.tensors[k]) for k in source.tensors)
            assert all(copy.tensors[k].data_ptr() != source.tensors[k].data_ptr() for k in source.tensors)
    finally:
        staged.release()
    assert as_source(WEIGHTS) == InMemory(WEIGHTS) and as_source(adapter) is adapter
    assert as_source(torch.nn.Linear(3, 4)).kind is UpdateKind.FULL


def test_an_adapter_into_a_full_weight_transport_is_refused_naming_both_kinds(tmp_path):
    update = WeightUpdate(1, AdapterWeights({"a": torch.ones(2)}, LoraConfig()))
    for transport in _full_transports(_model_dir(tmp_path), tmp_path):
        assert transport.accepts == frozenset({UpdateKind.FULL})
        with pytest.raises(WeightUpdateError, match=rf"its '{transport.kind}' transport carries full updates, not "
                                                    r"this adapter update .*cannot load a LoRA adapter"):
            check_carries("e", transport, update)
        check_carries("e", transport, WeightUpdate(1, InMemory(WEIGHTS)))  # what it carries passes


def test_full_weights_into_the_adapter_transport_are_refused_naming_both_kinds(tmp_path):
    manifest = read_manifest(_model_dir(tmp_path))
    transport = AdapterTransport("e", None, manifest, LoraServingConfig(), torch.float32)  # type: ignore[arg-type]
    assert transport.accepts == frozenset({UpdateKind.ADAPTER})
    with pytest.raises(WeightUpdateError, match=r"its 'lora' transport carries adapter updates, not this full update "
                                                r".*serves LoRA adapters"):
        check_carries("e", transport, WeightUpdate(1, InMemory(WEIGHTS)))
    check_carries("e", transport, WeightUpdate(1, AdapterWeights({}, LoraConfig())))


async def test_an_engine_refuses_an_unsupported_kind_before_anything_is_staged(tmp_path):
    """The embedded engine's client takes full weights only: an adapter is refused in ``prepare`` with nothing
    written to its staging directory and no call sent (the URL answers nothing)."""
    staging = tmp_path / "staging"
    staging.mkdir()
    engine = RemoteControlEngine("http://127.0.0.1:9", "token", _model_dir(tmp_path), staging_dir=staging)
    try:
        with pytest.raises(WeightUpdateError, match="carries full updates, not this adapter update"):
            await engine.prepare(WeightUpdate(1, AdapterWeights({"a": torch.ones(2)}, LoraConfig())))
        assert list(staging.iterdir()) == []
    finally:
        await engine.close()


async def test_files_are_written_for_tensors_in_memory_and_adopted_where_already_staged(tmp_path):
    manifest = read_manifest(_model_dir(tmp_path))
    written = await stage_as_files(WeightUpdate(1, InMemory(WEIGHTS)), manifest, torch.float32, tmp_path)
    assert written.source.files is written.staged  # the next engine of a pool adopts these files
    adopted = await stage_as_files(WeightUpdate(1, written.source), manifest, torch.float32, tmp_path)
    assert adopted.staged is written.staged and len(list(tmp_path.glob(".asyncrl-staging-*"))) == 1
    adopted.staged.release()
    written.staged.release()
    assert not written.staged.path.exists()


@pytest.mark.parametrize("bad_at", [None, 0, 9, 99])
def test_the_snapshot_finite_check_sees_every_chunk(bad_at):
    # The CUDA IPC snapshot is checked in chunks (a whole-size mask costs 7 GiB at 7B): a NaN anywhere, the
    # first chunk or the short last one included, is found; a clean snapshot passes.
    flat = torch.arange(100, dtype=torch.bfloat16)
    if bad_at is not None:
        flat[bad_at] = float("nan") if bad_at % 2 else float("inf")
    assert all_finite(flat, chunk=8) is (bad_at is None)
    assert all_finite(torch.empty(0, dtype=torch.bfloat16), chunk=8)
