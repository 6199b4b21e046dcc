"""The learner's optimisers beyond torch's own: ``StochasticAdamW``, AdamW for bfloat16 weights.

Full fine-tuning beside an engine on one GPU leaves room for bfloat16 weights, gradients and AdamW states (8 bytes
a parameter, against 16 with float32 states and master weights). Plain AdamW on bfloat16 weights rounds each new
weight to the nearest bfloat16, so an update smaller than half the spacing between neighbours (2**-9 to 2**-8
of the weight's size; with lr 1e-6, nearly every update) is lost, every step. Stochastic rounding keeps it in
expectation: a float32 value between two neighbours goes to the upper one with probability equal to its
distance from the lower one, over their spacing, so the weights follow the float32 trajectory on average.

``StochasticAdamW`` is torch's AdamW (decoupled weight decay, bias correction, the same ``lr``, ``betas``,
``eps``, ``weight_decay``) with its states in each parameter's dtype. The maths runs in float32 on bounded chunks
of each tensor (``chunk_elements``), so a 545M-element embedding never needs whole-tensor float32 copies, and
the new weight and states are written back by stochastic rounding. Float32 parameters get the exact update
(the same as ``torch.optim.AdamW(foreach=False)``), with no rounding.

Randomness is counter-based: the bits an element is rounded with are a hash of its index and a key derived
from (``seed``, the parameter's position in the optimiser, its step count, its shard). No generator state is
carried, so a run reproduces from its seed, a resumed run continues exactly from ``state_dict()`` (the seed and
the step counts are in it; a sharded DCP checkpoint, which keeps only the states and the parameter groups, is
enough too), and the chunk size, or the device, changes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CHUNK_ELEMENTS", "TEMPORARY_BYTES_PER_ELEMENT", "StochasticAdamW", "random_bits", "stochastic_round"]

CHUNK_ELEMENTS = 1 << 24  # float32 maths on at most this many elements of a tensor at a time
# Bytes a step allocates per element of a chunk at its peak: float32 copies of the moments, the denominator and
# the new weight, plus the rounding's int64 hash and int32 bits (measured 28 in tests/actors/test_memory.py).
TEMPORARY_BYTES_PER_ELEMENT = 32
ROUNDED = (torch.bfloat16,)  # written back by stochastic rounding
EXACT = (torch.float32,)  # updated in place, exactly
_MASK32 = 0xFFFFFFFF
_LOW16 = -(1 << 16)  # int32 mask keeping a float32's sign, exponent and 7 mantissa bits: its bfloat16 part
# Odd multipliers below 2**31 (so a 32-bit value times one fits an int64), drawn at random once.
_MULTIPLIERS = (0x6C1B838F, 0x6E13EDB5, 0x49400E3F)


def random_bits(key: int | torch.Tensor, start: int | torch.Tensor, count: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """16 random bits (int32 in [0, 2**16)) for elements ``start .. start + count`` of a tensor, under ``key``.

    Element ``i`` gets ``mix((i * A + key) mod 2**32)``'s top 16 bits, ``mix`` a bijection of 32-bit values
    (xor-shifts and odd multiplications). For a key drawn uniformly, ``i * A + key`` is uniform, so each
    element's bits are exactly uniform: rounding with them is unbiased element by element. ``key`` and ``start``
    may be int64 scalar tensors on ``device``: the compiled update takes them so, to compile once for all."""
    a, b, c = _MULTIPLIERS
    x = torch.arange(count, dtype=torch.int64, device=device).add_(start)
    x.mul_(a).add_(key).bitwise_and_(_MASK32)
    for m, shift in ((b, 16), (c, 15)):  # int64 throughout: no product overflows
        x.bitwise_xor_(x >> shift).mul_(m).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16)
    return (x >> 16).to(torch.int32)


def stochastic_round(x: torch.Tensor, key: int, start: int = 0) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically: 16 random bits added to its bit pattern, the low 16
    bits then dropped. It lands on the neighbour above with probability (x - below) / (above - below), so the
    rounding is unbiased. ``start``: ``x``'s offset in the tensor it is a chunk of (its elements' indices)."""
    return _rounded(x, key, start).to(torch.bfloat16)  # exact: the dropped bits are zero


def _rounded(x: torch.Tensor, key: int | torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
    """``stochastic_round`` still in float32, its low 16 bits zero (a bfloat16 value, which ``copy_`` into a
    bfloat16 tensor converts exactly)."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes float32, got {x.dtype}")
    bits = random_bits(key, start, x.numel(), x.device).view(x.shape)
    # On the bit pattern, adding grows the magnitude whatever the sign; only a NaN could carry into the sign bit.
    return bits.add_(x.view(torch.int32)).bitwise_and_(_LOW16).view(torch.float32)


@dataclass(frozen=True, slots=True)
class _Coefficients:
    """One parameter's AdamW step, in scalars."""

    beta1: float
    beta2: float
    eps: float
    decay: float  # 1 - lr * weight_decay
    step_size: float  # lr / (1 - beta1**t)
    bc2_sqrt: float  # sqrt(1 - beta2**t)


class StochasticAdamW(torch.optim.Optimizer):
    """AdamW whose states are kept in the parameters' dtype and whose bfloat16 parameters and states are written
    back by stochastic rounding (module docstring). Parameters must be bfloat16 or float32 (float16's narrow range
    would overflow the second moment). DTensor parameters (FSDP2) are updated shard by shard on ``to_local()``;
    their states are DTensors laid out as the parameter, so sharded checkpoints hold them as they do AdamW's.

    ``seed`` fixes the rounding's randomness: the same seed, parameters and gradients give the same weights,
    whatever ``chunk_elements`` or the device. It is kept in each parameter group, so ``state_dict()`` carries it.
    Shards of one parameter on different ranks draw different bits; replicated parameters draw the same, so
    replicas stay identical.

    ``compiled``: bfloat16 parameters are updated by one ``torch.compile``d function (dynamic shapes; its
    coefficients, keys and offsets passed as tensors, so it compiles once, not every step). Eager, each chunk is
    dozens of launches and as many passes over memory, most of them the rounding's int64 hash: at 7B on an H100
    a step took dozens of times torch's fused AdamW, compiled a few times (docs/BENCHMARKS.md). Compiled, the
    same maths runs fused; its float32 arithmetic may round differently from eager's in the last place, so a run
    keeps one setting (the seed's reproducibility holds within it). Float32 parameters keep the eager, exact
    update."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 seed: int = 0, chunk_elements: int = CHUNK_ELEMENTS, compiled: bool = False) -> None:
        for name, value, ok in (("lr", lr, lr >= 0), ("eps", eps, eps >= 0), ("weight_decay", weight_decay,
                                weight_decay >= 0), ("betas", betas, all(0 <= b < 1 for b in betas)),
                                ("chunk_elements", chunk_elements, chunk_elements >= 1), ("seed", seed, seed >= 0)):
            if not ok:
                raise ValueError(f"StochasticAdamW {name}={value!r} is out of range")
        self.chunk_elements = chunk_elements
        self.compiled = compiled
        # The compiled update, made once per optimiser: dynamic, so chunks of every length share one graph.
        self._fused = torch.compile(_adamw_chunk_fused, dynamic=True, fullgraph=True) if compiled else None
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "seed": seed})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.dtype not in ROUNDED + EXACT:
                self.param_groups.pop()  # not half added
                raise ValueError(f"StochasticAdamW keeps bfloat16 or float32 parameters; one of shape "
                                 f"{tuple(p.shape)} is {p.dtype} (use torch.optim.AdamW, or convert the model)")

    def temporary_bytes(self) -> int:
        """The most bytes one ``step`` allocates besides the states: one chunk's float32 maths, for the largest
        (local) parameter held (``asyncrl.actors.memory`` adds it to the optimiser step's peak)."""
        largest = max((_local(p).numel() for g in self.param_groups for p in g["params"]), default=0)
        return TEMPORARY_BYTES_PER_ELEMENT * min(largest, self.chunk_elements)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # the parameter's position over all groups: what state_dict() numbers it by
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, index)
                index += 1
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], index: int) -> None:
        if p.grad.is_sparse:
            raise RuntimeError("StochasticAdamW does not take sparse gradients")
        state = self.state[p]
        if not state:  # states laid out as the parameter (a DTensor's as its shards), contiguous
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["step"] += 1
        t = int(state["step"].item())
        beta1, beta2 = group["betas"]
        c = _Coefficients(beta1, beta2, group["eps"], 1 - group["lr"] * group["weight_decay"],
                          group["lr"] / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t))
        keys = _keys(group["seed"], index, t, _shard(p))
        tensors = [_local(x) for x in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
        work = [x if x.is_contiguous() else x.contiguous() for x in tensors]  # chunks are slices of a flat view
        flat = [x.view(-1) for x in work]
        update = self._chunk_update(p.dtype, c, keys, flat[0].device)
        for start in range(0, flat[0].numel(), self.chunk_elements):
            end = start + self.chunk_elements
            update(*(x[start:end] for x in flat), start)
        for x, w in zip(tensors, work, strict=True):
            if w is not x:
                x.copy_(w)

    def _chunk_update(self, dtype: torch.dtype, c: _Coefficients, keys: Sequence[int], device: torch.device
                      ) -> Callable[..., None]:
        """``update(p, g, m, v, start)`` for one parameter's chunks: the compiled update for bfloat16 when
        ``compiled`` (its scalars as tensors on ``device``), else the eager one."""
        fused = self._fused
        if fused is None or dtype not in ROUNDED:
            return lambda p, g, m, v, start: _adamw_chunk(p, g, m, v, c, keys, start)
        coefficients = torch.tensor(dataclasses.astuple(c), dtype=torch.float32, device=device)
        key_tensor = torch.tensor(keys, dtype=torch.int64, device=device)
        return lambda p, g, m, v, start: fused(p, g, m, v, coefficients, key_tensor,
                                               torch.tensor(start, dtype=torch.int64, device=device))


def _adamw_chunk(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: _Coefficients,
                 keys: Sequence[int], start: int) -> None:
    """One chunk of AdamW, in float32. For a float32 tensor ``.float()`` is the tensor itself, so the in-place
    maths updates it exactly and ``_store`` has nothing to do; the gradient is never written."""
    g32 = g.float()
    m32 = m.float().lerp_(g32, 1 - c.beta1)
    v32 = v.float().mul_(c.beta2).addcmul_(g32, g32, value=1 - c.beta2)
    del g32
    # The states are rounded stochastically too: with beta2 = 0.999 the second moment moves by about 1e-3 of
    # itself a step, under half a bfloat16 spacing (2**-9 of itself at least), so rounded to nearest it would
    # stop tracking the gradient's scale. This step uses their float32 values; the next one reads the rounded.
    _store(v, v32, keys[2], start)
    denom = v32.sqrt().div_(c.bc2_sqrt).add_(c.eps)
    del v32
    p32 = p.float().mul_(c.decay).addcdiv_(m32, denom, value=-c.step_size)
    del denom
    _store(m, m32, keys[1], start)
    del m32
    _store(p, p32, keys[0], start)


def _adamw_chunk_fused(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                       coefficients: torch.Tensor, keys: torch.Tensor, start: torch.Tensor) -> None:
    """``_adamw_chunk`` for bfloat16 tensors, written to be compiled: the scalars are tensors (``_Coefficients``
    in order; the three keys; the chunk's offset), the maths out of place so the compiler fuses it."""
    beta1, beta2, eps, decay, step_size, bc2_sqrt = coefficients.unbind()
    g32 = g.float()
    m32 = torch.lerp(m.float(), g32, 1 - beta1)
    v32 = v.float() * beta2 + g32 * g32 * (1 - beta2)
    p32 = p.float() * decay - m32 / (v32.sqrt() / bc2_sqrt + eps) * step_size
    for dst, value, key in ((v, v32, keys[2]), (m, m32, keys[1]), (p, p32, keys[0])):
        dst.copy_(_rounded(value, key, start))


def _store(dst: torch.Tensor, value: torch.Tensor, key: int, start: int) -> None:
    if dst.dtype in EXACT:
        if value.data_ptr() != dst.data_ptr():
            dst.copy_(value)
    else:
        dst.copy_(_rounded(value, key, start))


def _keys(seed: int, index: int, step: int, shard: tuple[int, ...]) -> tuple[int, int, int]:
    """Three 32-bit keys (weight, first and second moment) for one parameter's step: a cryptographic hash, so
    keys of different steps, parameters and shards are independent and uniform (what ``random_bits`` needs)."""
    digest = hashlib.blake2b(f"{seed}/{index}/{step}/{shard}".encode(), digest_size=12).digest()
    return tuple(int.from_bytes(digest[i:i + 4], "little") for i in (0, 4, 8))  # type: ignore[return-value]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view: writing it writes the DTensor), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _shard(t: torch.Tensor) -> tuple[int, ...]:
    """This rank's coordinates along the mesh dimensions a DTensor is split over (``()`` otherwise): different
    shards get different bits, replicas the same ones. A dimension of one rank splits nothing, so a DTensor on
    one rank is rounded as the plain tensor would be."""
    mesh, placements = getattr(t, "device_mesh", None), getattr(t, "placements", ())
    coordinate = mesh.get_coordinate() if mesh is not None else None
    if coordinate is None:
        return ()
    return tuple(c for dim, (c, placement) in enumerate(zip(coordinate, placements, strict=True))
                 if placement.is_shard() and mesh.size(dim) > 1)
