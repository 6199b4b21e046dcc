"""A stand-in for the ``kernels`` package, for TRL's AsyncGRPOTrainer on a host without network access.

The trainer asks ``get_kernel("kernels-community/flash-attn3")`` (downloaded from the Hugging Face Hub at run
time) for ``flash_attn_varlen_func``. This serves the same call with PyTorch's own variable-length attention
(``torch.nn.attention.varlen.varlen_attn``: FlashAttention-2 kernels built into torch, forward and backward),
or, on a torch without it, with one ``scaled_dot_product_attention`` per sequence. Causal masks align to the
bottom right, as FlashAttention's do when a query segment is shorter than its keys. Only what TRL's
``tree_attention`` passes is supported: causal, no sliding window, no softcap. Used by
``bench/peers/trl_async_side.py`` only, through ``PYTHONPATH``.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace

import torch

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.9
    varlen_attn = None

_PARAMS = set(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else set()
DESCRIPTION = ("torch.nn.attention.varlen.varlen_attn (FlashAttention-2 in torch) standing in for flash-attn3"
               if varlen_attn is not None else "per-sequence torch SDPA standing in for flash-attn3")


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, **_):
    if tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError("the kernels stand-in supports neither sliding windows nor softcap")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if varlen_attn is None:
        return _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    kwargs = {}
    if "enable_gqa" in _PARAMS:
        kwargs["enable_gqa"] = k.shape[1] != q.shape[1]
    elif k.shape[1] != q.shape[1]:  # older torch: one KV head per query head
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if "scale" in _PARAMS:
        kwargs["scale"] = scale
    else:  # the default scale is 1/sqrt(d): fold the difference into the queries
        q = q * (scale * math.sqrt(q.shape[-1]))
    if "window_size" in _PARAMS:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    cu_q, cu_k = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    return varlen_attn(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), **kwargs)


def _per_sequence(q, k, v, cu_q, cu_k, scale, causal):
    from torch.nn.attention.bias import causal_lower_right

    out = torch.empty_like(q)
    bounds = list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))
    for q0, q1, k0, k1 in bounds:
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        mask = causal_lower_right(q1 - q0, k1 - k0) if causal else None
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                             enable_gqa=ks.shape[1] != qs.shape[1])
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def get_kernel(name: str, version: object = None) -> SimpleNamespace:
    return SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func, name=name, version=version)
