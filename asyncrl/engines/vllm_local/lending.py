"""The in-process engine lends its weights to a LoRA learner on the same GPU (``VLLMEngine.lend_base``).

A LoRA learner beside its engine would otherwise hold a second copy of the frozen base (14.2 GiB at 7B in
bfloat16). The engine's workers hand out a CUDA IPC handle per parameter (``AsyncRLWorkerExtension
.asyncrl_lend_weights``); this process maps them, and ``asyncrl.lora.share_base`` points the learner's frozen
parameters at them. Nothing is copied: the learner reads the very memory the engine samples from, which never
changes, since a LoRA engine's publications carry adapters only.

What keeps an engine from lending, checked before anything is mapped:
- a CPU engine: its workers repack linear weights into kernel layouts, and CPU tensors cross processes only
  through shared memory;
- an engine serving full weights: every publication rewrites them under the learner (an engine serving
  adapters never sleeps, which would free them: ``VLLMEngineConfig`` refuses LoRA with sleep);
- quantization: the served weights are no longer the base the learner was trained against;
- more than one worker: tensor-parallel shards are no learner's base.
The mapping is valid while the engine runs: a learner that outlives its engine must not run again.
"""

from __future__ import annotations

import pickle

from asyncrl.engines.vllm_local.config import VLLMEngineConfig, is_cpu_platform
from asyncrl.engines.vllm_local.ipc import Rpc
from asyncrl.engines.vllm_local.worker_ext import open_ipc_tensor
from asyncrl.errors import ConfigError
from asyncrl.lora.shared_base import LentBase


def refusal(cfg: VLLMEngineConfig) -> tuple[str, str] | None:
    """``(field, reason)`` if an engine of ``cfg`` cannot lend its weights, else None."""
    if is_cpu_platform():
        return "VLLMEngineConfig", "weights are lent over CUDA IPC, and this engine runs on the CPU"
    if cfg.lora is None:
        return "VLLMEngineConfig.lora", ("this engine serves full weights, which every publication rewrites: only "
                                         "an engine serving adapters keeps its base fixed")
    if cfg.quantization is not None:
        return "VLLMEngineConfig.quantization", (f"the engine serves {cfg.quantization} weights, not the base the "
                                                 "learner trains on")
    return None


async def lend(engine: str, cfg: VLLMEngineConfig, rpc: Rpc) -> LentBase:
    """Map the weights of ``engine`` (its config ``cfg``, its workers reached through ``rpc``) into this
    process."""
    if (why := refusal(cfg)) is not None:
        raise ConfigError(why[0], f"engine {engine} cannot lend its weights: {why[1]}")
    payloads = await rpc("asyncrl_lend_weights")
    if len(payloads) != 1:
        raise ConfigError("VLLMEngineConfig.extra", f"engine {engine} runs {len(payloads)} workers: tensor-parallel "
                                                    "shards cannot be a learner's base (lend from one worker)")
    doc = pickle.loads(payloads[0])
    tensors = {name: open_ipc_tensor(handle, doc["device_uuid"]) for name, handle in doc["params"].items()}
    return LentBase(engine, tensors, doc["packed"])
