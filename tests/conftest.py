"""Shared fixtures: a tiny locally built model and, for tests marked ``vllm``, one real vLLM engine per
session (an engine belongs to the event loop that created it, so those tests share the session loop); a staging
folder; and real vLLM servers, one set per module, on the module's own ``model_dir``."""

from __future__ import annotations

import gc
import os
import signal
import warnings
from pathlib import Path

import pytest
import pytest_asyncio

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(CACHE / "vllm"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A shell without job control starts background jobs with SIGINT ignored, and every child inherits that: the
# Ctrl-C tests would see a script that never hears it. Take SIGINT back for this process, so children get the
# default again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="module")
def _earlier_garbage_collected(request: pytest.FixtureRequest) -> None:
    """Before a module that turns warnings into errors, free what earlier modules left in reference cycles,
    with their warnings reported as warnings. Such a module would otherwise fail on another module's garbage:
    vLLM leaves a zmq context unclosed when an engine starts, and one caught in a cycle warns whenever a later
    full collection happens to free it. (A collection costs ~0.2 s with torch and vLLM loaded: other modules
    skip it.)"""
    if request.node.get_closest_marker("filterwarnings") is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        gc.collect()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from asyncrl.testing.tasks import arithmetic
    from asyncrl.testing.tiny import build_tiny

    return build_tiny(CACHE / "models" / "tiny-arith", arithmetic.corpus())


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_model_dir: Path):
    """One real vLLM engine for the session. Tests must not close it; they may publish weights."""
    from asyncrl.engines.vllm_local import VLLMEngine

    from tests.support import engine_config

    engine = await VLLMEngine.start(engine_config(tiny_model_dir), name="session-vllm")
    yield engine
    await engine.close()


@pytest.fixture
def staging(tmp_path: Path) -> Path:
    """An empty folder to stage weight updates in."""
    out = tmp_path / "staging"
    out.mkdir()
    return out


# The real vLLM server of tests/engines/vllm_remote/test_remote_engine*.py, one per module: kept for the session,
# an idle server would sit beside every later module (its processes among theirs). The model is built once.


@pytest.fixture(scope="session")
def remote_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.remote_engine import remote_model

    return remote_model(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(remote_model_dir: Path):
    """The servers' model in transformers, in eval mode: the reference for their log-probs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(remote_model_dir), dtype=torch.float32).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server_a(remote_model_dir: Path):
    """A vLLM server on ``remote_model_dir``. Tests may publish weights to it; none may stop it."""
    from tests.support.remote_engine import served

    async for server in served(remote_model_dir):
        yield server
