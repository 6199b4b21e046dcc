"""The learner's model FLOPs utilisation: the FLOPs a step's batch needs by the model's shape, over the time the
learner spent in its steps, over the device's dense bf16 peak.

Counted per trained sequence of ``s`` positions (prompt + completion) with ``c`` scored positions (completion):
a forward pass costs ``2 * N * s`` for the decoder's matrices (``N``: every weight but the embedding), ``2 * h * V
* c`` for the head (it runs on the scored positions alone: ``asyncrl.algorithms.head``) and ``2 * L * q * s^2``
for causal attention (scores and values, half of the square). Full fine-tuning is three forwards (the backward
computes input and weight gradients); LoRA two (the frozen weights need no gradient; the adapter's FLOPs are
negligible). Model FLOPs, as MFU counts them: gradient checkpointing's recomputation is work done, not counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# Dense bf16 peak of the devices the GPU runs get, FLOP/s (SXM parts; sparse figures are twice these).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}


def peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


class FlopCount:
    """A learner ``StepRecorder`` that adds up the model FLOPs of every trained batch."""

    def __init__(self, model: Any, *, lora: bool) -> None:
        cfg = model.config
        d, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
        head_dim = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        self.matrices = layers * (d * (q + 2 * kv) + q * d + 3 * d * inter)
        self.head = d * cfg.vocab_size
        self.attention = layers * q
        self.passes = 2 if lora else 3
        self.steps: list[float] = []  # model FLOPs of each trained batch

    def batch_flops(self, batch: Sequence[Any]) -> float:
        forward = 0.0
        for group in batch:
            prompt = len(group.prompt.token_ids)
            for r in group.rollouts:
                c = len(r.sample.token_ids)
                s = prompt + c
                forward += 2 * self.matrices * s + 2 * self.head * c + 2 * self.attention * s * s
        return self.passes * forward

    async def record(self, step: int, policy_version: int, served_version: int, batch: Sequence[Any],
                     metrics: Mapping[str, float], totals: Any) -> None:
        self.steps.append(self.batch_flops(batch))

    async def aclose(self) -> None:
        return None

    def report(self, train_s: float) -> dict[str, Any]:
        """Model TFLOPs per step, achieved TFLOP/s over the learner's step time, and MFU where the peak is known."""
        peak = peak_flops()
        achieved = sum(self.steps) / train_s if train_s else 0.0
        return {"model_tflops_per_step": [f / 1e12 for f in self.steps], "learner_tflops_per_s": achieved / 1e12,
                "learner_mfu": achieved / peak if peak else None, "mfu_passes": self.passes}
