"""asyncrl's worker extension plus what only tests ask of a vLLM worker (loaded by name in the worker)."""

from __future__ import annotations

from asyncrl.engines.vllm_local.worker_ext import AsyncRLWorkerExtension, own_input_queue


class TestWorkerExtension(AsyncRLWorkerExtension):
    __test__ = False  # not a pytest test class

    def asyncrl_input_wait_kind(self) -> str:
        """The class that waits for this worker's next scheduler message ("" if not found)."""
        return type(getattr(own_input_queue(), "_spin_condition", None)).__name__
