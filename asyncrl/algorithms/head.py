"""Log-probs (and entropy) of chosen tokens straight from the decoder's last hidden states, a chunk of positions
at a time, never holding the ``[tokens, vocab]`` logits in float32.

Scoring through ``model(...).logits`` keeps, for the backward, bf16 logits at every position plus a float32
copy of the scored ones, their tempered copy and their log-softmax: for a 16k-token micro-batch of a
Qwen2-0.5B shape (vocabulary 151,936) that is about 40 GB, and the passes over it took about a fifth of a
learner step's device time on an H200. Here each chunk's logits are formed, reduced to the chosen token's
log-prob and the log-normaliser, and dropped; the backward forms them again chunk by chunk (one more
vocabulary matmul, cheaper than the memory traffic it replaces). Only completion tokens that are scored go
through the vocabulary projection, not prompt or padding positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

# Decoders whose causal-LM forward is exactly ``lm_head(decoder(...).last_hidden_state)``: no logit scaling
# or soft-capping that scoring from hidden states would skip.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
CHUNK_ELEMENTS = 1 << 28  # float32 logits per chunk (1 GiB): a few chunks per micro-batch, each a large matmul
def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """The decoder and output projection to score from hidden states, or None where the model must be called
    whole: an unknown architecture, a biased head, or a sharded (FSDP) model, whose root-level parameters are
    gathered only by the root module's own forward. (``ScoringOptions.from_logits`` skips asking.)"""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or decoder is None or decoder is model:
        return None
    if _sharded(model):
        return None
    return decoder, head


def _sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch build without distributed: nothing can be sharded
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def chosen_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                    with_entropy: bool, compiled: bool = False) -> tuple[Tensor, Tensor | None]:
    """``[M]`` float32 log-probs of ``targets`` under ``hidden @ weight.T / temperature`` (``hidden`` ``[M, H]``,
    ``weight`` ``[V, H]``), and the entropy of the same distribution when asked. Differentiable in ``hidden``
    and ``weight``; under autocast the projection runs in autocast's dtype, as ``nn.Linear`` would.
    ``compiled``: each chunk's softmax maths (forward and backward) runs as kernels fused by ``torch.compile``,
    one pass over the chunk's logits instead of one per element-wise step (``ScoringOptions.compiled_head``)."""
    chunk = max(1, CHUNK_ELEMENTS // weight.shape[0])
    logprobs, entropy = _ChosenLogprobs.apply(hidden, weight, targets, float(temperature), chunk, with_entropy,
                                              compiled)
    return logprobs, (entropy if with_entropy else None)


def _tempered(raw: Tensor, temperature: float) -> Tensor:
    z = raw.float()
    return z.div_(temperature) if temperature != 1.0 else z


class _ChosenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,  # type: ignore[override]
                chunk: int, with_entropy: bool, compiled: bool) -> tuple[Tensor, Tensor]:
        m = hidden.shape[0]
        chunk_maths = _fused("forward") if compiled else _chunk_forward
        lse = torch.empty(m, dtype=torch.float32, device=hidden.device)
        logprobs, entropy = torch.empty_like(lse), torch.zeros_like(lse)
        dtype = hidden.dtype
        for s in range(0, m, chunk):
            e = s + chunk
            raw = torch.nn.functional.linear(hidden[s:e], weight)  # autocast picks its dtype, as for nn.Linear
            dtype = raw.dtype
            lse[s:e], logprobs[s:e], entropy[s:e] = chunk_maths(raw, targets[s:e], temperature, with_entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.dtype = temperature, chunk, with_entropy, dtype
        ctx.compiled = compiled
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, grad_entropy: Tensor | None):  # type: ignore[override]
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        dt, t = ctx.dtype, ctx.temperature
        h_all, w = hidden.to(dt), weight.to(dt)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        wants_entropy = ctx.with_entropy and grad_entropy is not None
        chunk_grad = _fused("backward") if ctx.compiled else _chunk_grad_in_place
        for s in range(0, hidden.shape[0], ctx.chunk):
            e = s + ctx.chunk
            h = h_all[s:e]
            g = chunk_grad(torch.nn.functional.linear(h, w), targets[s:e], lse[s:e], entropy[s:e],
                           grad_logprobs[s:e], grad_entropy[s:e] if wants_entropy else None, t)
            if grad_hidden is not None:
                grad_hidden[s:e] = (g @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += g.T @ h
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def _chunk_grad_in_place(raw: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g_lp: Tensor,
                         g_ent: Tensor | None, t: float) -> Tensor:
    """d loss / d raw logits of one chunk, in raw's dtype, reusing one float32 buffer (eager mode)."""
    z = _tempered(raw, t)
    # d logp_target / dz = onehot(target) - p;  d entropy / dz = -p * (z - E_p[z]), E_p[z] = lse - entropy
    spread = z - (lse - entropy)[:, None] if g_ent is not None else None
    p = z.sub_(lse[:, None]).exp_()  # in place: at 150k vocabulary each pass over z is costly
    g_e = None if spread is None else spread.mul_(p).mul_(g_ent[:, None])
    g = p.mul_(-g_lp[:, None])
    g.scatter_add_(-1, targets[:, None], g_lp[:, None])
    if g_e is not None:
        g.sub_(g_e)
    return (g.div_(t) if t != 1.0 else g).to(raw.dtype)


def _chunk_forward(raw: Tensor, targets: Tensor, t: float, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(log-normaliser, chosen log-prob, entropy or 0) of one chunk, eager or compiled."""
    z = _tempered(raw, t)
    lse = torch.logsumexp(z, dim=-1)
    chosen = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else torch.zeros_like(lse)
    return lse, chosen, entropy


def _chunk_grad(raw: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g_lp: Tensor, g_ent: Tensor | None,
                t: float) -> Tensor:
    """``_chunk_grad_in_place`` written functionally for ``torch.compile`` (one fused pass over the chunk)."""
    z = raw.float() / t
    p = torch.exp(z - lse[:, None])
    hit = torch.arange(z.shape[-1], device=z.device)[None, :] == targets[:, None]
    g = (hit.float() - p) * g_lp[:, None]
    if g_ent is not None:
        g = g - (z - (lse - entropy)[:, None]) * p * g_ent[:, None]
    return (g / t).to(raw.dtype)


@functools.cache
def _fused(which: str) -> Callable[..., object]:
    """The compiled chunk maths, built once per process on first use (dynamic shapes: chunks vary in rows)."""
    return torch.compile(_chunk_forward if which == "forward" else _chunk_grad, dynamic=True)
