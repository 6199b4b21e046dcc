"""The publication probe: after each publication, the target's log-probs of one sequence must equal the learner's.

A publication can land without error and still leave the engine serving other weights: an adapter registered but
never named by requests, a reload that silently kept a layer, a pool member that missed the update (verl #7495 is
the adapter case). Training then goes on against the wrong policy, and nothing else notices. The probe scores one
real sequence (the prompt and first completion of the last batch trained, cut to ``SyncConfig.probe_tokens``) with
the learner's weights exactly as published, in the training thread right when the publication's weights are taken,
and on the target (``WeightTarget.score``, every engine of a pool) once the publication has resumed it. A largest
per-token difference above ``SyncConfig.probe_tolerance`` fails the run with ``PublicationMismatch``.

The tolerance is the precision gap between learner and engine: about 1e-4 where both compute in float32 (CPU),
a few hundredths in bfloat16. It runs one scoring request per publication.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from asyncrl.engines.protocols import WeightTarget
from asyncrl.errors import PublicationMismatch
from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)

__all__ = ["Expectation", "PublicationMismatch", "PublicationProbe", "policy_logprobs"]


@dataclass(frozen=True, slots=True)
class Expectation:
    """The learner's log-probs of ``token_ids`` under the weights being published."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


class PublicationProbe:
    """Remembers a probe sequence from the batches trained; checks each publication against the learner."""

    def __init__(self, target: WeightTarget, tolerance: float, max_tokens: int) -> None:
        self.target = target
        self.tolerance = tolerance
        self.max_tokens = max_tokens
        self._ids: tuple[int, ...] | None = None
        self.checks = 0  # publications checked
        self.last_diff: float | None = None  # largest per-token difference at the last check

    def remember(self, batch: Sequence[RolloutGroup]) -> None:
        """Take the probe sequence from a batch just trained (a real prompt and completion: in the vocabulary, in
        the engine's context)."""
        for group in batch:
            if group.rollouts:
                ids = group.prompt.token_ids + group.rollouts[0].sample.token_ids
                if len(ids) >= 2:
                    self._ids = ids[:self.max_tokens]
                    return

    def expect(self, score: Callable[[Sequence[int]], list[float]]) -> Expectation | None:
        """In the training thread, with the weights being published (``TrainingBackend.score``): the learner's
        side (None before any batch)."""
        if self._ids is None:
            return None
        return Expectation(self._ids, tuple(score(self._ids)))

    async def check(self, version: int, expected: Expectation | None) -> None:
        """Score the probe on the target, which must serve ``version`` now; ``PublicationMismatch`` if any engine
        differs from the learner by more than ``tolerance``."""
        if expected is None:
            return
        scored = await self.target.score(expected.token_ids)
        worst = 0.0
        for engine, logprobs in scored.items():
            if len(logprobs) != len(expected.logprobs):
                raise PublicationMismatch(f"probe of v{version} on {engine}: {len(logprobs)} log-probs for "
                                          f"{len(expected.logprobs)} tokens")
            diff = max(abs(a - b) for a, b in zip(logprobs, expected.logprobs, strict=True))
            if diff > self.tolerance:
                raise PublicationMismatch(
                    f"after publishing v{version}, {engine} scores the probe sequence {diff:.4g} away from the "
                    f"learner (largest per-token log-prob difference; tolerance {self.tolerance:g}): it serves "
                    f"other weights than were published")
            worst = max(worst, diff)
        self.checks += 1
        self.last_diff = worst
        log.debug("probe of v%d: largest difference %.3g over %d engines", version, worst, len(scored))

    def metrics(self) -> dict[str, float]:
        return {} if self.last_diff is None else {"sync/probe_max_diff": self.last_diff}


@torch.no_grad()
def policy_logprobs(model: torch.nn.Module, token_ids: Sequence[int]) -> list[float]:
    """Log-prob of each token after the first given those before it, at temperature 1 (eval mode: no dropout)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([list(token_ids)], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
    finally:
        model.train(was_training)
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return picked.tolist()
