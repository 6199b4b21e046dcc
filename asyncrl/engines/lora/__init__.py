"""Serving LoRA adapters on a frozen base, on every engine that can: the transport that stages an adapter and
loads it per version (``transport``), and the two ends it talks to, vLLM in this process (``in_process``) and a vLLM
server's run-time adapter routes (``server``). Training an adapter is ``asyncrl.lora``'s."""

from asyncrl.engines.lora.transport import AdapterTransport, LoraServingConfig, ServedAdapter

__all__ = ["AdapterTransport", "LoraServingConfig", "ServedAdapter"]
