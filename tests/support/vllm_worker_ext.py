"""asyncrl's worker extension plus what only tests ask of a vLLM worker (loaded by name in the worker)."""

from __future__ import annotations

from asyncrl.engines.vllm_local.worker_ext import AsyncRLWorkerExtension, own_input_queue, packed_modules


class TestWorkerExtension(AsyncRLWorkerExtension):
    __test__ = False  # not a pytest test class

    def asyncrl_input_wait_kind(self) -> str:
        """The class that waits for this worker's next scheduler message ("" if not found)."""
        return type(getattr(own_input_queue(), "_spin_condition", None)).__name__

    def asyncrl_weight_copies(self) -> bytes:
        """Copies of the served model's parameters under vLLM's names, with its packed modules: what
        ``asyncrl_lend_weights`` maps over CUDA IPC, by value, so the mapping can be checked on the CPU."""
        import pickle

        model = self.model_runner.get_model()
        tensors = {name: p.detach().clone() for name, p in model.named_parameters()}
        return pickle.dumps({"tensors": tensors, "packed": packed_modules(model)})
