"""Variable-length attention for packed rows: each sequence attends only within itself, at the cost of its own
length, with no mask.

transformers scores packed rows through sdpa with a block-diagonal mask it builds from the restarting
``position_ids``: a masked kernel that still visits the whole ``[row, row]`` square (so rows are kept as narrow
as the longest sequence), and a mask of ``row**2`` bytes per forward. A varlen kernel takes the packed tokens
as one ``[tokens, heads, dim]`` stream with the cumulative sequence starts instead, so a whole micro-batch can
be a single row with no padding and each sequence costs ``length**2`` attention, not ``row**2``.

``install(model)`` registers this as a transformers attention implementation (``VARLEN``) and switches the
model to it. Calls that carry ``Segments`` (``completion_logprobs`` passes them for packed rows) run the varlen
kernel: torch's flash ``varlen_attn`` on a GPU in bf16/fp16, one causal sdpa call per sequence elsewhere (the
reference: same maths, no speed). Every other call behaves as sdpa does: a padding mask is honoured, and an
unmasked call with restarting positions is split at the restarts (one host sync per layer: correct, not fast).
"""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from asyncrl.algorithms.rows import to_device
from asyncrl.errors import ConfigError

VARLEN = "asyncrl_varlen"
SEGMENTS_KWARG = "asyncrl_segments"
# Text-only decoders whose layers hand unknown forward kwargs on to the attention function, and whose masks
# have no overlay (images, bidirectional blocks) that dropping the mask would lose.
VARLEN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True, slots=True)
class Segments:
    """Where each sequence sits in the flattened ``[rows * width]`` token stream."""

    cu: Tensor  # [S + 1] int32 on the model's device: start of each segment, then the total
    max_len: int  # the longest segment

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], device: torch.device) -> Segments:
        if not lengths or min(lengths) <= 0:
            raise ValueError(f"segments need positive lengths, got {list(lengths)!r}")
        cu = np.fromiter(itertools.accumulate(lengths, initial=0), dtype=np.int32, count=len(lengths) + 1)
        return cls(cu=to_device(cu, device), max_len=max(lengths))


def install(model: torch.nn.Module) -> None:
    """Switch a transformers Llama, Mistral or Qwen decoder to ``VARLEN`` attention (registered once)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in VARLEN_MODEL_TYPES or not hasattr(model, "set_attn_implementation"):
        raise ConfigError("LearnerConfig.varlen_attention",
                          f"needs a transformers decoder of type {sorted(VARLEN_MODEL_TYPES)}, "
                          f"got {type(model).__name__} (model_type {model_type!r})")
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        raise ConfigError("LearnerConfig.varlen_attention",
                          f"does not support sliding-window attention (sliding_window={config.sliding_window})")
    _register()
    model.set_attn_implementation(VARLEN)


def active(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == VARLEN


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: object, attention_mask: Tensor | None = None, **kwargs: object) -> Tensor | None:
        # No padding mask: plain causal or packed, both handled in ``attention`` without a [row, row] mask.
        return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    AttentionInterface.register(VARLEN, attention)
    AttentionMaskInterface.register(VARLEN, mask)


def attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              dropout: float = 0.0, scaling: float | None = None, **kwargs: object) -> tuple[Tensor, None]:
    """transformers' attention-function contract: ``query`` ``[B, Hq, L, D]``, ``key``/``value``
    ``[B, Hkv, L, D]``; returns ``[B, L, Hq, D]``."""
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None and attention_mask is None:
        segments = _from_positions(kwargs.get("position_ids"), query.shape[0], query.shape[2], query.device)
    if segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise ValueError(f"varlen attention has no dropout, got {dropout}")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("varlen attention does not support sliding-window layers")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))  # [B * L, H, D]
    device = query.device.type
    if torch.is_autocast_enabled(device):  # as sdpa does under autocast (rotary leaves q and k in float32)
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = varlen_causal(q, k, v, segments, scale)
    return out.view(query.shape[0], query.shape[2], *out.shape[1:]), None


def _from_positions(position_ids: object, rows: int, width: int, device: torch.device) -> Segments | None:
    """Segments from positions that restart at 0 (and at each row start), or None without positions."""
    if not isinstance(position_ids, Tensor):
        return None
    flat = position_ids.expand(rows, width).flatten()
    starts = (flat == 0) | (torch.arange(flat.numel(), device=flat.device) % width == 0)
    bounds = [*starts.nonzero().flatten().tolist(), flat.numel()]
    return Segments.from_lengths([b - a for a, b in itertools.pairwise(bounds)], device)


def varlen_causal(q: Tensor, k: Tensor, v: Tensor, segments: Segments, scale: float) -> Tensor:
    """Causal attention within each segment: ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return _flash(q, k, v, segments, scale)
    if q.is_cuda:  # correct but one kernel launch per sequence: say so (Python shows it once per place)
        warnings.warn(f"varlen attention on a GPU in {q.dtype} runs the per-sequence reference, not flash: "
                      "use a bf16/fp16 model or autocast", RuntimeWarning, stacklevel=2)
    return reference_varlen_causal(q, k, v, segments, scale)


def reference_varlen_causal(q: Tensor, k: Tensor, v: Tensor, segments: Segments, scale: float) -> Tensor:
    """One causal sdpa call per segment: the same maths as the flash kernel, for CPUs and float32."""
    outs = []
    for a, b in itertools.pairwise(segments.cu.tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=ks.shape[0] != qs.shape[0]).transpose(0, 1))
    return torch.cat(outs)


def _kernel() -> tuple[Callable[..., Tensor] | None, frozenset[str]]:
    """torch's flash varlen kernel (torch >= 2.10) and its parameter names, or None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


# Looked up once, at import: not in every layer's call, and not where torch.compile traces a layer whole.
_VARLEN_ATTN, _VARLEN_PARAMS = _kernel()


def _flash(q: Tensor, k: Tensor, v: Tensor, segments: Segments, scale: float) -> Tensor:
    # The signature grew across torch releases (2.11: a causal window but no grouped-query heads; 2.13: both):
    # ask for what it offers, do the rest here.
    varlen_attn, params = _VARLEN_ATTN, _VARLEN_PARAMS
    if varlen_attn is None:
        raise RuntimeError(f"varlen attention on a GPU needs torch >= 2.10 (torch.nn.attention.varlen), "
                           f"this is {torch.__version__}")
    kwargs: dict[str, object] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:
        q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel's default scale is 1/sqrt(D)
    n = segments.max_len
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), segments.cu, segments.cu, n, n, **kwargs)
