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
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
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
    """Built with a few whole-array operations on the host (not a few per sequence), then sent to ``device`` in
    one copy: at a learner's micro-batch sizes the per-sequence version cost milliseconds of host time per
    micro-batch, and each of its copies waited for the device to drain."""
    n, rows = len(prompts), 1 + max(r for r, _ in placement)
    p_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    c_len = torch.tensor([len(c) for c in completions], dtype=torch.long)
    row_of = torch.tensor([r for r, _ in placement], dtype=torch.long)
    at = torch.tensor([a for _, a in placement], dtype=torch.long)
    size = p_len + c_len
    width, steps = int((at + size).max()), int(c_len.max())
    # Every token of every sequence: its flat index in [rows * width] and its position within its sequence.
    local = _ranges(size)
    flat = torch.repeat_interleave(row_of * width + at, size) + local
    input_ids = torch.full((rows * width,), pad_id, dtype=torch.long)
    input_ids[flat] = _flat(itertools.chain.from_iterable(x for p, c in zip(prompts, completions) for x in (p, c)),
                            int(size.sum()))
    attention_mask = torch.zeros(rows * width, dtype=torch.long)
    attention_mask[flat] = 1
    position_ids = _tail_positions(row_of, at + size, size, rows, width)
    position_ids[flat] = local
    # Completion token j of sequence i: logits at index at + len(prompt) + j - 1 predict it.
    j = _ranges(c_len)
    grid = torch.repeat_interleave(torch.arange(n) * steps, c_len) + j  # flat index into [n, steps]
    score_at = torch.zeros(n * steps, dtype=torch.long)
    score_at[grid] = torch.repeat_interleave(at + p_len - 1, c_len) + j
    targets = torch.full((n * steps,), pad_id, dtype=torch.long)
    targets[grid] = _flat(itertools.chain.from_iterable(completions), len(j))
    mask = torch.zeros(n * steps, dtype=torch.long)
    mask[grid] = _mask_values(completions, loss_masks)
    scored = mask.nonzero().squeeze(1)
    hidden_at = (torch.repeat_interleave(row_of, steps) * width + score_at)[scored]
    shapes = [(rows, width)] * 3 + [(n,), (n, steps), (n, steps), (n, steps), scored.shape, scored.shape]
    tensors = [t.view(s) for t, s in zip(_to_device([input_ids, attention_mask, position_ids, row_of, score_at,
                                                     targets, mask, scored, hidden_at], device), shapes)]
    tensors[6] = tensors[6].to(torch.float32)
    if not packed:
        return Rows(*tensors)
    tensors[1] = None
    return Rows(*tensors, segments=_segments(placement, size.tolist(), width, rows))


def _ranges(lengths: Tensor) -> Tensor:
    """``0..n-1`` for each ``n`` in ``lengths``, back to back."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)


def _tail_positions(row_of: Tensor, ends: Tensor, sizes: Tensor, rows: int, width: int) -> Tensor:
    """[rows * width] positions where each row's tail padding (after every real token, so causally unseen)
    continues the positions of the row's last sequence; the real tokens' positions are written over the rest."""
    last_end = torch.zeros(rows, dtype=torch.long).scatter_reduce(0, row_of, ends, "amax")
    is_last = ends == last_end[row_of]
    last_size = torch.zeros(rows, dtype=torch.long).index_copy(0, row_of[is_last], sizes[is_last])
    column = torch.arange(width)
    return (last_size[:, None] + column[None, :] - last_end[:, None]).flatten()


def _mask_values(completions: Sequence[Sequence[int]],
                 loss_masks: Sequence[Sequence[int] | None] | None) -> Tensor:
    count = sum(len(c) for c in completions)
    if loss_masks is None:
        return torch.ones(count, dtype=torch.long)
    return _flat(itertools.chain.from_iterable(m if m is not None else [1] * len(c)
                                               for m, c in zip(loss_masks, completions)), count)


def _flat(values: Iterable[int], count: int) -> Tensor:
    """A long tensor of ``count`` ints (a few times faster than ``torch.tensor`` of a list at 10^4-10^5)."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int64, count=count))


def _to_device(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Long CPU tensors onto ``device`` as flat views of one buffer. To a GPU it is one copy from pinned memory
    that does not wait for the device, where a copy per tensor would each wait for it to drain."""
    if device.type == "cpu":
        return tensors
    sizes = [t.numel() for t in tensors]
    staged = torch.cat(tensors)
    if device.type == "cuda":
        staged = staged.pin_memory()
    return list(staged.to(device, non_blocking=True).split(sizes))


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
