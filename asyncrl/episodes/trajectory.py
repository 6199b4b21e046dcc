"""Flat trajectories: model turns and environment tokens concatenated id by id, with a loss mask.

Nothing is decoded and encoded again: a turn's ids are appended exactly as the engine returned them, and the
environment's exactly as it returned them. The next turn's context is the prompt followed by these same ids.
"""

from __future__ import annotations

from asyncrl.types import FinishReason, Sample, Trajectory, VersionSpan


class TrajectoryBuilder:
    """Accumulates one episode's tokens after the prompt."""

    __slots__ = ("token_ids", "logprobs", "loss_mask", "spans", "texts", "first_version")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.spans: list[VersionSpan] = []
        self.texts: list[str] = []
        self.first_version: int | None = None  # the version the first turn was requested under

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_turn(self, turn: Sample) -> None:
        """A model turn: its ids, log-probs and spans (moved to where the turn starts in the trajectory)."""
        if self.first_version is None:
            self.first_version = turn.version_spans[0].version
        offset = len(self.token_ids)
        for span in turn.version_spans:
            if span.end > span.start:
                self.spans.append(VersionSpan(span.version, span.start + offset, span.end + offset))
        self.token_ids.extend(turn.token_ids)
        self.logprobs.extend(turn.logprobs)
        self.loss_mask.extend([1] * len(turn.token_ids))
        self.texts.append(turn.text)

    def add_env(self, token_ids: tuple[int, ...], text: str) -> None:
        """Environment tokens: in the context, out of the loss (mask 0, log-prob 0.0, no version)."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.loss_mask.extend([0] * len(token_ids))
        self.texts.append(text)

    def build(self, finish_reason: FinishReason) -> Trajectory:
        spans = tuple(self.spans) or (VersionSpan(self.first_version or 0, 0, 0),)
        return Trajectory(token_ids=tuple(self.token_ids), logprobs=tuple(self.logprobs), finish_reason=finish_reason,
                          version_spans=spans, text="".join(self.texts), loss_mask=tuple(self.loss_mask))


def turn_slices(sample: Sample) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of model tokens: one per turn whenever the environment appended tokens
    between turns. A plain sample is one run."""
    mask = sample.loss_mask
    if mask is None:
        return [(0, len(sample.token_ids))] if sample.token_ids else []
    runs: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def model_token_ids(sample: Sample) -> tuple[int, ...]:
    """The ids the model sampled, in order (environment tokens left out)."""
    if sample.loss_mask is None:
        return sample.token_ids
    return tuple(t for t, m in zip(sample.token_ids, sample.loss_mask) if m)
