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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

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
                row_tokens: int | float | None = None, width_multiple: int = 1) -> Rows:
    """Sequences packed into rows of at most ``row_tokens`` tokens (default: the longest sequence, so a row is
    never wider than the padded layout's and attention, quadratic in row width under sdpa, costs no more;
    ``math.inf``: one row holding everything, for variable-length attention). Rows are then widened with
    padding to a multiple of ``width_multiple``."""
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    placement = pack(lengths, min(row_tokens or max(lengths), sum(lengths)))
    return _layout(prompts, completions, pad_id, device, loss_masks, placement, packed=True,
                   width_multiple=width_multiple)


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
            placement: Sequence[tuple[int, int]], *, packed: bool, width_multiple: int = 1) -> Rows:
    """Built with whole-array numpy operations on the host (not a few torch calls per sequence: milliseconds
    per micro-batch), then sent to ``device`` in one copy that does not wait for the device."""
    n, rows = len(prompts), 1 + max(r for r, _ in placement)
    p_len, c_len = (np.fromiter(map(len, seqs), dtype=np.int64, count=n) for seqs in (prompts, completions))
    row_of = np.fromiter((r for r, _ in placement), dtype=np.int64, count=n)
    at = np.fromiter((a for _, a in placement), dtype=np.int64, count=n)
    size = p_len + c_len
    width, steps = round_up(int((at + size).max()), width_multiple), int(c_len.max())
    # Every token of every sequence: its flat index in [rows * width] and its position within its sequence.
    local = _ranges(size)
    flat = np.repeat(row_of * width + at, size) + local
    input_ids = np.full(rows * width, pad_id, dtype=np.int64)
    input_ids[flat] = np.fromiter(itertools.chain.from_iterable(x for p, c in zip(prompts, completions)
                                                                for x in (p, c)), dtype=np.int64, count=len(flat))
    attention_mask = np.zeros(rows * width, dtype=np.int64)
    attention_mask[flat] = 1
    position_ids = _tail_positions(row_of, at + size, size, rows, width)
    position_ids[flat] = local
    # Completion token j of sequence i: logits at index at + len(prompt) + j - 1 predict it.
    j = _ranges(c_len)
    grid = np.repeat(np.arange(n) * steps, c_len) + j  # flat index into [n, steps]
    score_at = np.zeros(n * steps, dtype=np.int64)
    score_at[grid] = np.repeat(at + p_len - 1, c_len) + j
    targets = np.full(n * steps, pad_id, dtype=np.int64)
    targets[grid] = np.fromiter(itertools.chain.from_iterable(completions), dtype=np.int64, count=len(j))
    mask = np.zeros(n * steps, dtype=np.int64)
    mask[grid] = _mask_values(completions, loss_masks, len(j))
    scored = np.flatnonzero(mask)
    hidden_at = (np.repeat(row_of, steps) * width + score_at)[scored]
    parts = [input_ids, attention_mask, position_ids, row_of, score_at, targets, mask, scored, hidden_at]
    shapes = [(rows, width)] * 3 + [(n,), (n, steps), (n, steps), (n, steps), scored.shape, scored.shape]
    on_device = to_device(np.concatenate(parts), device).split([len(p) for p in parts])
    tensors = [t.view(s) for t, s in zip(on_device, shapes)]
    tensors[6] = tensors[6].to(torch.float32)
    if not packed:
        return Rows(*tensors)
    tensors[1] = None
    return Rows(*tensors, segments=_segments(placement, size.tolist(), width, rows))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """A host array as a tensor on ``device``. To a GPU it goes through pinned memory, so the copy is queued
    without waiting: a plain copy from pageable memory waits for every kernel queued before it."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host.to(device)
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.numpy()[...] = array
    return staged.to(device, non_blocking=True)


def _ranges(lengths: np.ndarray) -> np.ndarray:
    """``0..n-1`` for each ``n`` in ``lengths``, back to back."""
    return np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _tail_positions(row_of: np.ndarray, ends: np.ndarray, sizes: np.ndarray, rows: int, width: int) -> np.ndarray:
    """[rows * width] positions where each row's tail padding (after every real token, so causally unseen)
    continues the positions of the row's last sequence; the real tokens' positions are written over the rest."""
    last_end = np.zeros(rows, dtype=np.int64)
    np.maximum.at(last_end, row_of, ends)
    is_last = ends == last_end[row_of]
    last_size = np.zeros(rows, dtype=np.int64)
    last_size[row_of[is_last]] = sizes[is_last]
    return (last_size[:, None] + np.arange(width)[None, :] - last_end[:, None]).reshape(-1)


def _mask_values(completions: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int] | None] | None,
                 count: int) -> np.ndarray | int:
    if loss_masks is None:
        return 1
    return np.fromiter(itertools.chain.from_iterable(m if m is not None else [1] * len(c)
                                                     for m, c in zip(loss_masks, completions)),
                       dtype=np.int64, count=count)


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
