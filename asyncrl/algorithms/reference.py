"""The frozen reference of a KL penalty: a separate model, or the policy itself under a context (with LoRA, the
policy with its adapter disabled is the base model: ``asyncrl.lora.LoraReference``, no second copy of the weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from asyncrl.algorithms.logprobs import PLAIN, ScoringOptions, completion_logprobs

__all__ = ["PolicyReference", "Reference", "reference_logprobs"]


class PolicyReference(Protocol):
    """A reference that is the policy under a context, e.g. ``asyncrl.lora.LoraReference``."""

    def scope(self, policy: torch.nn.Module) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The module that scores as the reference while the returned context is open; ``policy`` is the model
        the loss is computing under (the one being trained)."""
        ...


Reference = torch.nn.Module | PolicyReference  # what a loss's ``ref_model`` may be


def reference_logprobs(ref: Reference, policy: torch.nn.Module, prompts: Sequence[Sequence[int]],
                       completions: Sequence[Sequence[int]], *, temperature: float, pad_id: int,
                       scoring: ScoringOptions = PLAIN) -> Tensor:
    """``completion_logprobs`` under the reference, without grad, scored as the policy is (``scoring``)."""
    scope = contextlib.nullcontext(ref) if isinstance(ref, torch.nn.Module) else ref.scope(policy)
    with torch.no_grad(), scope as model:
        return completion_logprobs(model, prompts, completions, temperature=temperature, pad_id=pad_id,
                                   scoring=scoring).logprobs
