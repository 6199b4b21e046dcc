"""How scored sequences (prompt + completion) are laid out as model input rows: padded or packed.

*Padded*: one sequence per row, right-padded to the longest; an attention mask hides the padding.
*Packed*: several sequences share a row, back to back, with ``position_ids`` restarting at 0 for each one and
no attention mask. transformers (``masking_utils.find_packed_sequence_indices``) reads the restarts as
sequence boundaries and builds a block-diagonal causal mask for sdpa, eager and flex attention, or
variable-length kernels for flash attention, so no token attends across sequences. That detection runs only
when the forward gets no 2D attention mask and no KV cache, hence ``use_cache=False`` in packed calls.

Either way each sequence sees the positions and context it would see alone, so the log-probs agree (up to
float rounding); packing just stops paying for padding tokens.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_PACKED = contextvars.ContextVar("asyncrl_packed_scoring", default=False)


@contextlib.contextmanager
def packed_scoring(enabled: bool = True) -> Iterator[None]:
    """Within this block ``completion_logprobs`` packs rows unless told otherwise. The learner enters it around
    each micro-batch (``LearnerConfig.packing``), like autocast, so a ``Loss`` needs no packing argument."""
    token = _PACKED.set(enabled)
    try:
        yield
    finally:
        _PACKED.reset(token)


def packing_enabled() -> bool:
    return _PACKED.get()


@dataclass(frozen=True, slots=True)
class Rows:
    """Model input for ``N`` sequences in ``R`` rows, and where each completion token is predicted."""

    input_ids: Tensor  # [R, L] long, padded with ``pad_id`` at the end of each row
    attention_mask: Tensor | None  # [R, L] long, 1 on real tokens (padded layout); None when packed
    position_ids: Tensor  # [R, L] long: 0.. within each sequence; a row's tail padding continues its last one
    row_of: Tensor  # [N] long: the row holding sequence i
    score_at: Tensor  # [N, T] long: index (in that row) whose logits predict each completion token
    targets: Tensor  # [N, T] long: the completion tokens, padded with ``pad_id``
    mask: Tensor  # [N, T] float32, 1 for a scored completion token
    scored: Tensor  # [M] long: flat index into [N, T] of each scored token (mask 1), in order
    hidden_at: Tensor  # [M] long: flat index into [R, L] of the position that predicts it
    # Packed only: lengths of the runs that tile the flattened [R * L] tokens, in order (each sequence, and each
    # row's tail padding as a run of its own), for variable-length attention kernels (``algorithms.varlen``).
    segments: tuple[int, ...] = ()

    @property
    def packed(self) -> bool:
        return self.attention_mask is None


def padded_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
                device: torch.device, loss_masks: Sequence[Sequence[int] | None] | None = None) -> Rows:
    """One sequence per row, each starting at index 0."""
    placement = [(i, 0) for i in range(len(prompts))]
    return _layout(prompts, completions, pad_id, device, loss_masks, placement, packed=False)


def packed_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
                device: torch.device, loss_masks: Sequence[Sequence[int] | None] | None = None,
                row_tokens: int | float | None = None) -> Rows:
    """Sequences packed into rows of at most ``row_tokens`` tokens (default: the longest sequence, so a row is
    never wider than the padded layout's and attention, quadratic in row width under sdpa, costs no more;
    ``math.inf``: one row holding everything, for variable-length attention)."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    placement = pack(lengths, min(row_tokens or max(lengths), sum(lengths)))
    return _layout(prompts, completions, pad_id, device, loss_masks, placement, packed=True)


def pack(lengths: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """First-fit decreasing: ``(row, offset)`` for each length, rows holding at most ``capacity`` (a longer
    sequence gets a row of its own). Deterministic, so every rank and every rerun packs alike."""
    fill: list[int] = []
    out: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        row = next((r for r, used in enumerate(fill) if used + lengths[i] <= capacity), len(fill))
        if row == len(fill):
            fill.append(0)
        out[i] = (row, fill[row])
        fill[row] += lengths[i]
    return out


def _layout(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
            device: torch.device, loss_masks: Sequence[Sequence[int] | None] | None,
            placement: Sequence[tuple[int, int]], *, packed: bool) -> Rows:
    n, rows = len(prompts), 1 + max(r for r, _ in placement)
    ends = [0] * rows
    for (row, offset), p, c in zip(placement, prompts, completions):
        ends[row] = max(ends[row], offset + len(p) + len(c))
    width, steps = max(ends), max(len(c) for c in completions)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, width), dtype=torch.long)
    position_ids = torch.zeros((rows, width), dtype=torch.long)
    row_of = torch.tensor([r for r, _ in placement], dtype=torch.long)
    score_at = torch.zeros((n, steps), dtype=torch.long)
    targets = torch.full((n, steps), pad_id, dtype=torch.long)
    mask = torch.zeros((n, steps), dtype=torch.float32)
    last_end = [(0, 0)] * rows  # per row: (end index, position there) of its last sequence
    for i, ((row, at), prompt, completion) in enumerate(zip(placement, prompts, completions)):
        size, k = len(prompt) + len(completion), len(completion)
        input_ids[row, at: at + size] = torch.tensor([*prompt, *completion], dtype=torch.long)
        attention_mask[row, at: at + size] = 1
        position_ids[row, at: at + size] = torch.arange(size)
        last_end[row] = max(last_end[row], (at + size, size))
        # logits at index t predict token t + 1, so completion token j is scored at at + len(prompt) + j - 1
        score_at[i, :k] = torch.arange(at + len(prompt) - 1, at + len(prompt) - 1 + k)
        targets[i, :k] = torch.tensor(list(completion), dtype=torch.long)
        row_mask = loss_masks[i] if loss_masks is not None else None
        mask[i, :k] = 1.0 if row_mask is None else torch.tensor(list(row_mask), dtype=torch.float32)
    for row, (end, pos) in enumerate(last_end):  # tail padding: after every real token, so causally unseen
        position_ids[row, end:] = torch.arange(pos, pos + width - end)
    scored = mask.flatten().nonzero().squeeze(1)  # on the host: finding them on the device would sync it
    hidden_at = (row_of[:, None] * width + score_at).flatten()[scored]
    tensors = [t.to(device) for t in (input_ids, attention_mask, position_ids, row_of, score_at, targets, mask,
                                      scored, hidden_at)]
    if not packed:
        return Rows(*tensors)
    tensors[1] = None
    return Rows(*tensors, segments=_segments(placement, [len(p) + len(c) for p, c in zip(prompts, completions)],
                                             width, rows))


def _segments(placement: Sequence[tuple[int, int]], lengths: Sequence[int], width: int, rows: int) -> tuple[int, ...]:
    """Run lengths tiling ``[rows * width]``: the sequences in row-major order, each row's tail padding apart."""
    starts = sorted((row * width + at, n) for (row, at), n in zip(placement, lengths))
    runs, cursor = [], 0
    for start, n in [*starts, (rows * width, 0)]:
        if start > cursor:  # a row's tail padding, up to the next row's first sequence (or the end)
            runs.append(start - cursor)
        if n:
            runs.append(n)
        cursor = start + n
    return tuple(runs)
