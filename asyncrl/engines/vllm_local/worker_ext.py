"""Runs inside each vLLM worker process (``worker_extension_cls``): the two weight-loading paths.

1. Reload from a staged safetensors directory (every platform, the only one that works on CPU, where linear
   weights are repacked after loading). It keeps tied weights tied, see below.
2. CUDA: the learner's tensors arrive through one CUDA IPC handle while generation still runs and are loaded
   (``model.load_weights``, so vLLM's own name mapping and shard fusing apply; vLLM's layerwise reload where
   the engine quantizes its weights) into *shadow* copies of the
   parameters. Under the pause, a commit copies shadows into the live parameters: one batched device copy,
   the same storage addresses (CUDA graphs stay valid), no Python loop over checkpoint names. While the
   engine sleeps (nothing generates) the update loads straight into the live parameters instead.

vLLM's layerwise reload replaces each loaded layer's parameters; a layer that shares a parameter with
another (e.g. ``lm_head`` tied to ``embed_tokens``) gets nothing from the checkpoint and keeps its old
kernel tensors, so after a sync the output head would still be the old one. We record the aliases before
the first reload and point them at the new parameters afterwards, redoing the alias layer's post-load
processing (on CPU that repacks the GEMM weights the head actually uses).

On CPU it also switches the worker's queue reader from spinning to napping (``executor``).

It also makes the worker exit fast: at exit the interpreter's final garbage collection walks vLLM's whole
heap (measured: 2 s per process on CPU, most of the 4 s an engine took to shut down), so the extension
freezes the heap first (``exit_fast``).

And it makes the engine's processes die with the program that started it (``starter_watch``).

On CUDA it lends its weights (``asyncrl_lend_weights``): IPC handles a LoRA learner maps as its frozen base.

LoRA adapters arrive from memory (``asyncrl_add_adapter``): the adapter's tensors, serialised in one safetensors
buffer, travel as the call's argument and become vLLM's ``LoRAModel`` here, registered under the id the requests
will name. No adapter file exists; vLLM's worker manager would read one only to reload an adapter it evicted,
which the publishing side never lets happen (``engines.lora.transport``).

Loaded by name in the worker, so keep this module light: nothing from asyncrl but ``exit_fast`` (and
``starter_watch``, standard library only, when asked).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.engines.vllm_local.exit_fast import exit_fast

LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _TiedLayerNotice(logging.Filter):
    """Drops the layerwise reload's "Failed to load weights" warning for layers that get no checkpoint
    tensors by design: aliases we re-tie afterwards, and buffer-only layers (rotary caches are computed, not
    loaded). The same warning for any other layer still shows."""

    def __init__(self, class_names: set[str]) -> None:
        super().__init__()
        self.class_names = class_names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.args and record.args[0] in self.class_names
                    and "Failed to load weights" in str(record.msg))


def tied_aliases(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """``(module path, attribute, canonical parameter name)`` for every parameter that aliases another."""
    canonical: dict[int, str] = {}
    aliases: list[tuple[str, str, str]] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            full = f"{mod_name}.{attr}" if mod_name else attr
            if id(param) in canonical and canonical[id(param)] != full:
                aliases.append((mod_name, attr, canonical[id(param)]))
            else:
                canonical.setdefault(id(param), full)
    return aliases


def retie(model: torch.nn.Module, aliases: list[tuple[str, str, str]]) -> None:
    for mod_name, attr, target in aliases:
        module = model.get_submodule(mod_name)
        setattr(module, attr, model.get_parameter(target))
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)


class AsyncRLWorkerExtension:
    """Mixed into vLLM's worker class; methods are called through ``collective_rpc``."""

    model_runner: Any  # provided by the worker


    def asyncrl_record_ties(self) -> int:
        """Called once after start-up, while ties are still intact. Returns how many aliases exist."""
        exit_fast()
        model = self.model_runner.get_model()
        self._asyncrl_aliases = tied_aliases(model)
        names = {type(model.get_submodule(mod)).__name__ for mod, _, _ in self._asyncrl_aliases}
        names |= {type(m).__name__ for m in model.modules()
                  if next(m.parameters(recurse=False), None) is None
                  and next(m.buffers(recurse=False), None) is not None}
        if names:
            logging.getLogger(LAYERWISE_LOGGER).addFilter(_TiedLayerNotice(names))
        return len(self._asyncrl_aliases)

    def asyncrl_store_file(self) -> str | None:
        """The file of vLLM's ``file://`` rendezvous for this worker, if it used one: vLLM never removes it (its
        processes end killed), so the engine removes it once they are gone."""
        method = getattr(self, "distributed_init_method", None) or ""
        return method.removeprefix("file://") if method.startswith("file://") else None

    def asyncrl_die_with(self, starter: int) -> bool:
        """Called once after start-up: end this engine's processes when ``starter`` exits (``starter_watch``)."""
        from asyncrl.engines.vllm_local.starter_watch import die_with

        return die_with(starter)

    def asyncrl_stop_busy_wait(self) -> bool:
        """Switch this worker's scheduler-input queue reader to napping (see ``executor``)."""
        from asyncrl.engines.vllm_local.executor import stop_busy_wait  # imports vLLM: only ever in a worker

        queue = own_input_queue()
        return queue is not None and stop_busy_wait(queue)

    def asyncrl_reload(self, weights_path: str) -> None:
        """Reload every weight from ``weights_path`` (a safetensors directory) and restore ties."""
        self.model_runner.reload_weights(weights_path=weights_path)
        retie(self.model_runner.get_model(), getattr(self, "_asyncrl_aliases", []))

    def asyncrl_stage_ipc(self, payload: bytes, version: int) -> int:
        """Load the weights behind a ``pack_for_ipc`` payload into the shadow parameters. Returns how many
        checkpoint tensors were read. The live parameters are untouched until ``asyncrl_commit``."""
        self._asyncrl_staged = None
        model = self.model_runner.get_model()
        with params_swapped(model, self._asyncrl_shadow_params(model)):
            count = self._asyncrl_load_payload(payload)
        self._asyncrl_staged = version
        return count

    def asyncrl_load_ipc(self, payload: bytes) -> int:
        """Load a ``pack_for_ipc`` payload straight into the live parameters: only while nothing generates
        (the engine sleeps, its weights woken), where the shadow copy would only cost memory."""
        return self._asyncrl_load_payload(payload)

    def _asyncrl_load_payload(self, payload: bytes) -> int:
        """Load checkpoint-format tensors into the parameters the model holds now (live or shadows).

        An engine that quantizes its weights as it loads them (``VLLMEngineConfig.quantization``, e.g. FP8 from
        a bf16 checkpoint) holds kernel-format parameters (FP8, transposed, with scales) that the checkpoint
        loaders cannot write. vLLM's layerwise reload takes them instead: it rebuilds each layer in checkpoint
        format, quantizes it again (new scales with the new weights, never stale ones) and copies the result
        into the parameters' own storage, which under ``params_swapped`` is the shadows'."""
        packed = pickle.loads(payload)
        flat = open_ipc_tensor(packed["handle"], packed["device_uuid"])
        weights = unpack(flat, packed["layout"])
        if self.model_runner.model_config.quantization is not None:
            self.model_runner.reload_weights(weights_iterator=weights)
        else:
            self.model_runner.get_model().load_weights(weights)
        torch.cuda.current_stream().synchronize()  # the learner frees ``flat`` as soon as this returns
        return len(packed["layout"])

    def asyncrl_add_adapter(self, name: str, lora_id: int, path: str, settings: dict[str, Any],
                            data: bytes | str) -> bool:
        """Register a LoRA adapter from ``data`` (a safetensors buffer; base64 text where the call came as
        JSON) under ``lora_id``; ``settings`` are its PEFT ``adapter_config.json`` fields, ``path`` what the
        requests naming it give as their path (vLLM requires one; nothing is read from it). Returns whether
        the worker's manager took it."""
        import base64

        from safetensors.torch import load as load_buffer
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        tensors = load_buffer(base64.b64decode(data) if isinstance(data, str) else data)
        manager = self.model_runner.lora_manager

        def from_memory(request: Any) -> Any:
            helper = PEFTHelper.from_dict(dict(settings))
            helper.validate_legal(manager.lora_config)
            model = manager._adapter_manager.model
            mapper = getattr(model, "hf_to_vllm_mapper", None)
            if mapper is not None:  # renames only, as vLLM's own loader does (0.26 and 0.32 name it apart)
                rename = getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper
                mapper = rename()
            return manager._lora_model_cls.from_lora_tensors(
                lora_model_id=request.lora_int_id, tensors=tensors, peft_helper=helper, device="cpu",
                dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
                skip_prefixes=getattr(model, "lora_skip_prefixes", None))

        # vLLM's manager loads through ``_load_adapter`` (from a directory); for this one call it loads from
        # memory instead, and everything else add_adapter does (capacity, activation) stays vLLM's.
        manager._load_adapter = from_memory
        try:
            return bool(manager.add_adapter(LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)))
        finally:
            del manager._load_adapter

    def asyncrl_release_shadows(self) -> None:
        """Free the shadow parameters (before sleeping: memory outside vLLM's pool is not freed by sleep).
        They are allocated again by the next ``asyncrl_stage_ipc``."""
        self._asyncrl_shadows = None
        self._asyncrl_staged = None
        torch.cuda.empty_cache()

    def asyncrl_commit(self, version: int) -> None:
        """Copy the staged shadows into the live parameters (call while generation is paused)."""
        staged = getattr(self, "_asyncrl_staged", None)
        if staged != version:
            raise RuntimeError(f"no staged weights for version {version} (staged: {staged!r})")
        live = dict(self.model_runner.get_model().named_parameters())
        names = list(self._asyncrl_shadows)
        torch._foreach_copy_([live[n].data for n in names], [self._asyncrl_shadows[n] for n in names])
        torch.cuda.current_stream().synchronize()
        self._asyncrl_staged = None

    def asyncrl_lend_weights(self) -> bytes:
        """CUDA IPC handles to every parameter the served model holds (vLLM's names, tied ones once), with the
        model's packed modules (``qkv_proj`` packs ``q_proj``, ``k_proj``, ``v_proj`` by rows) and this GPU's
        UUID: what a LoRA learner maps as its frozen base (``engines.vllm_local.lending``)."""
        from torch.multiprocessing.reductions import reduce_tensor

        model = self.model_runner.get_model()
        params = {name: reduce_tensor(p.data) for name, p in model.named_parameters()}
        return pickle.dumps({"params": params, "packed": packed_modules(model),
                             "device_uuid": device_uuid(torch.cuda.current_device())})

    def _asyncrl_shadow_params(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        # Allocated once and reused: one extra copy of the weights in the engine's memory. Cloned, not empty:
        # a parameter the loader never writes (none should be) then keeps its live value instead of garbage.
        if getattr(self, "_asyncrl_shadows", None) is None:
            self._asyncrl_shadows = {n: p.data.clone() for n, p in model.named_parameters()}
        return self._asyncrl_shadows


def packed_modules(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """vLLM's fused modules and the checkpoint modules each stacks by rows, in order (``qkv_proj``: ``q_proj``,
    ``k_proj``, ``v_proj``): the model class's ``packed_modules_mapping``, empty where it fuses nothing."""
    return {fused: tuple(parts) for fused, parts in getattr(model, "packed_modules_mapping", {}).items()}


def own_input_queue() -> Any:
    """The worker's scheduler-input ``MessageQueue``, or None.

    vLLM gives the worker no handle to its own ``WorkerProc``, so we find it on the call stack: RPCs run
    inside ``WorkerProc.worker_busy_loop``.
    """
    frame = sys._getframe()
    while frame is not None:
        queue = getattr(frame.f_locals.get("self"), "rpc_broadcast_mq", None)
        if queue is not None:
            return queue
        frame = frame.f_back
    return None


# -- CUDA IPC: the worker side (the learner side is ``ipc.py``; lending runs it the other way round) ----------


def device_uuid(device: torch.device | int) -> str:
    """The GPU's UUID: the one name of a device that both ends of a CUDA IPC handle agree on."""
    return str(torch.cuda.get_device_properties(device).uuid)


def open_ipc_tensor(handle: tuple[Any, tuple[Any, ...]], sender_uuid: str) -> torch.Tensor:
    """Rebuild the sender's tensor here. The sender's device index may name another GPU in this process
    (different ``CUDA_VISIBLE_DEVICES``), so the device is found by UUID."""
    rebuild, args = handle
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == sender_uuid:
            args = (*args[:6], index, *args[7:])  # argument 6 of rebuild_cuda_tensor is the device index
            break
    else:
        raise RuntimeError(f"GPU {sender_uuid} of the tensors' sender is not visible to this process")
    return rebuild(*args)


def unpack(flat: torch.Tensor, layout: list[tuple[str, tuple[int, ...], int, int]]) -> Iterator[
        tuple[str, torch.Tensor]]:
    for name, shape, offset, numel in layout:
        yield name, flat[offset:offset + numel].view(shape)


@contextlib.contextmanager
def params_swapped(model: torch.nn.Module, shadows: dict[str, torch.Tensor]) -> Iterator[None]:
    """Point every parameter at its shadow for the duration (weight loaders write ``param.data``).
    Safe because the worker runs RPCs between model steps, never during one."""
    params = dict(model.named_parameters())
    live = {n: p.data for n, p in params.items()}
    try:
        for name, param in params.items():
            param.data = shadows[name]
        yield
    finally:
        for name, param in params.items():
            param.data = live[name]
