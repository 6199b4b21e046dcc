"""LoRA training (PEFT, the ``asyncrl[lora]`` extra): the adapter's config (``config``) and the wrapped policy, its
adapter tensors, the base model as the KL reference, and export (``model``); its frozen base held once, in the
engine beside it (``shared_base``). Publication of the adapter into
vLLM is the adapter transport's (``asyncrl.engines.lora.transport``): see docs/ARCHITECTURE.md, "LoRA"."""

from asyncrl.lora.config import DEFAULT_TARGETS, LoraConfig
from asyncrl.lora.model import (
    LoraReference, adapter_state, apply_lora, export_adapter, export_merged, is_lora, load_adapter_state,
    merged_state, reference_context,
)
from asyncrl.lora.shared_base import share_base

__all__ = ["DEFAULT_TARGETS", "LoraConfig", "LoraReference", "adapter_state", "apply_lora", "export_adapter",
           "export_merged", "is_lora", "load_adapter_state", "merged_state", "reference_context", "share_base"]
