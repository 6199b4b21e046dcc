"""Checkpoints of a sharded learner with ``torch.distributed.checkpoint`` (DCP), and their export to the
Hugging Face format.

``save_sharded`` is a collective: every rank writes its own shards of the weights and the optimiser state
(DCP's ``.distcp`` files plus its metadata), rank 0 then writes ``meta.json`` (where the run stands: step,
version, data cursor...) and, last, ``COMPLETE``. DCP keys tensors by parameter name and records how each
was split, so ``load_sharded`` reads a checkpoint into any number of ranks, FSDP-sharded or a plain model in
one process (``torch.distributed`` not even initialised). ``export_hf`` writes the weights as a transformers
model directory (config, safetensors, tokenizer) that vLLM and transformers load:

    python -m asyncrl.distributed.export CKPT_DIR --model-dir START_MODEL_DIR --out HF_DIR

A LoRA model (``asyncrl.lora.apply_lora``, sharded or not) is checkpointed as its adapter alone: the parameters
that require grad and the optimiser state over them; its frozen base is the model the run started from and is
not written. ``meta.json`` then says ``"weights": "adapter"`` (as the single-process store's does), and loading
needs the same base wrapped with the same ``LoraConfig``: an adapter checkpoint and a plain model (or the other
way round) are refused. ``export_hf`` takes full-weight checkpoints only.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.lora.model import is_lora

log = logging.getLogger(__name__)

META_FILE = "meta.json"
COMPLETE_FILE = "COMPLETE"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                    "merges.txt", "generation_config.json", "chat_template.jinja")


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(model)
    frozen = _frozen(model) if is_lora(model) else set()
    # torch leaves out frozen parameters by their first name only: a tied alias (``lm_head.weight``) stays
    states: dict[str, Any] = {"model": {k: v for k, v in get_model_state_dict(model, options=options).items()
                                        if k not in frozen}}
    if optimizer is not None:  # also gives a fresh optimiser its state tensors, so DCP can load into them
        states["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    return states


def _options(model: torch.nn.Module) -> Any:
    """A LoRA model's state is its trainable parameters alone (the adapter; buffers too, if it has any that
    persist); it is loaded non-strictly, the missing keys checked by ``_check_loaded``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = is_lora(model)
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _frozen(model: torch.nn.Module) -> set[str]:
    """Every name of every frozen parameter, tied aliases included."""
    return {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}


def _weights_meta(model: torch.nn.Module) -> dict[str, Any]:
    """What ``meta.json`` records about the weights: nothing for full weights; an adapter's base otherwise."""
    if not is_lora(model):
        return {}
    base = model.peft_config["default"].base_model_name_or_path  # type: ignore[index]
    return {"weights": "adapter", "lora_base": str(base)}


def save_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 meta: Mapping[str, Any]) -> Path:
    """Every rank: write a DCP checkpoint of ``model`` and ``optimizer`` into ``path`` (a new directory); of a
    LoRA model's adapter alone. ``meta`` (JSON-serialisable) is written by rank 0 once every rank's shards are
    on disk, with ``"weights": "adapter"`` added for a LoRA model."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    text = json.dumps({**meta, **_weights_meta(model)})  # fails here, before any collective, if ``meta`` is not JSON
    dcp.save(_states(model, optimizer), checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if not dist.is_initialized() or dist.get_rank() == 0:
        (path / META_FILE).write_text(text)
        (path / COMPLETE_FILE).write_text("")
    if dist.is_initialized():
        dist.barrier()
    log.info("sharded checkpoint saved: %s", path)
    return path


def save_backend(backend: Any, path: str, meta: Mapping[str, Any]) -> Path:
    """``save_sharded`` of a training backend's model and optimiser (picklable, for ``FSDPBackend.call``)."""
    return save_sharded(path, backend.model, backend.optimizer, meta)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta`` of a complete checkpoint; ``FileNotFoundError`` for a torn one."""
    path = Path(path)
    if not (path / COMPLETE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (no {COMPLETE_FILE})")
    return json.loads((path / META_FILE).read_text())


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                 ) -> dict[str, Any]:
    """Read a checkpoint into ``model`` (and ``optimizer``), whatever the number of ranks it was saved from and
    is loaded into (every rank calls it; one process without a process group works too). Returns its meta.
    ``ValueError`` when an adapter checkpoint meets a model without an adapter, or the other way round."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    meta = read_meta(path)
    adapter = meta.get("weights") == "adapter"
    if adapter != is_lora(model):
        held = "a LoRA adapter" if adapter else "full weights"
        raise ValueError(f"{path} holds {held}, and the model to restore into is "
                         f"{'not ' if adapter else ''}wrapped by asyncrl.lora.apply_lora")
    states = _states(model, optimizer)
    with warnings.catch_warnings():  # loading in one process is what no_dist asks for: no need to warn
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(states, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    _check_loaded(model, set_model_state_dict(model, states["model"], options=_options(model)))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, states["optim"], options=_options(model))
    return meta


def _check_loaded(model: torch.nn.Module, result: Any) -> None:
    """A non-strict (LoRA) load left out the frozen parameters and nothing else."""
    missing = sorted(set(result.missing_keys) - _frozen(model))
    if missing or result.unexpected_keys:
        raise ValueError(f"the checkpoint's adapter does not match the model's: missing {missing[:4]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:4]}")


def export_hf(path: str | Path, model_dir: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> Path:
    """One process: the checkpoint's weights as a transformers model directory ``out``, with the config and
    tokenizer of ``model_dir`` (the model the run started from)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # on CPU: buffers initialised
    load_sharded(path, model)
    model.tie_weights()  # a tied head points at the loaded embedding again
    if dtype is not None:
        model.to(dtype)
    out = Path(out)
    model.save_pretrained(str(out))
    for name in _TOKENIZER_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out / name)
    return out
