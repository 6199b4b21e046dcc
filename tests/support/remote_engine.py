"""Helpers shared by the tests against real vLLM servers (not fixtures): the servers' model and arguments, the
client config, and the reference log-probs of a transformers model."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from asyncrl.engines.protocols import BehaviourPrecision
from asyncrl.engines.vllm_remote import RemoteEngineConfig, server_precision_args
from asyncrl.engines.vllm_remote.process import ServerProcess, free_port, group_members, start_vllm_server
from asyncrl.testing.tasks import arithmetic
from asyncrl.testing.tiny import TinyModelSpec, build_tiny
from tests.support import SERVER_TEST_ARGS

PROMPT = (1, 10, 11, 12, 13)
MAX_MODEL_LEN = 256  # the servers' context: room for long samples, so that a pause finds them running
# Server vs transformers (on CPU) log-probs, float32. On the H200 (vLLM 0.26, Triton attention) they were seen
# up to 3.7e-3 apart on this model: GPU kernels sum in another order. Still well under the 0.05 a sync changes.
TOL = 1e-2 if torch.cuda.is_available() else 1e-3
SERVED_PRECISION = BehaviourPrecision("float32")  # what the shared servers are started in (server_precision_args)


def remote_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The servers' model (built once per session: conftest.py's ``remote_model_dir``)."""
    # Big enough (19M parameters) that the engine, not the API server's per-token streaming, is what limits
    # generation speed: with the 0.4M default, a loaded machine let the engine finish every sample before a
    # pause got through. Tied embeddings (the default): the sync test checks the LM head follows them.
    spec = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4)
    return build_tiny(tmp_path_factory.mktemp("remote") / "model", arithmetic.corpus(), spec)


def _device_args() -> list[str]:
    """The servers' arguments. The tests also run on a GPU machine (vLLM 0.26 there): float32 needs Triton
    attention."""
    args = [*SERVER_TEST_ARGS, *server_precision_args(SERVED_PRECISION), "--max-model-len", str(MAX_MODEL_LEN)]
    if torch.cuda.is_available():
        args += ["--gpu-memory-utilization", "0.2", "--attention-backend", "TRITON_ATTN"]
    return args


async def served(model_dir: Path) -> AsyncIterator[ServerProcess]:
    """A server on ``model_dir``; once it stops, none of its processes or socket files may be left."""
    async with start_vllm_server(model_dir, free_port(), extra_args=_device_args()) as server:
        yield server
    assert not group_members(server.pgid), "server processes left behind"
    assert server.rpc_dir is not None and not server.rpc_dir.exists(), "vLLM's socket files left behind"


def _cfg(server: ServerProcess, model_dir: Path, **kw: object) -> RemoteEngineConfig:
    return RemoteEngineConfig(base_url=server.base_url, model=server.model_name, model_dir=str(model_dir),
                              health_check_interval_s=1.0, **kw)  # type: ignore[arg-type]


def _hf_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1, at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return out


SEQS = [[1, 5, 17, 33, 9, 60, 61, 4, 21, 88, 3, 44], [1, 70, 2, 71, 15, 15, 15, 90, 6, 7, 8, 9]]
