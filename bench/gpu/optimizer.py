"""``LearnerConfig(optimizer="adamw_bf16")``: the step time of ``StochasticAdamW`` over a shape's bf16 parameters,
eager and compiled (``compiled=True``, what a compiling learner gets), beside torch's fused AdamW over the same
parameters (round to nearest: what it would lose), its temporaries against what the memory plan counts, and on a
GPU the same update on CPU and GPU. Writes ``optimizer_<gpu or cpu>_<shape>.json``.

    python -m bench.gpu.optimizer --shape qwen2.5-7b             # a GPU
    python -m bench.gpu.optimizer --device cpu --shape qwen2-0.5b
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import Result, parser
from bench.gpu.planted import tensor_shapes


def timed(optimizer: Any, steps: int, device: str) -> dict[str, float]:
    """Seconds a step after the first (which creates the states, and compiles); on a GPU, the memory the states
    hold and a step's temporaries."""
    import torch

    cuda = device == "cuda"
    t0 = time.perf_counter()
    optimizer.step()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if cuda:
        torch.cuda.synchronize()
    out = {"step_s": (time.perf_counter() - t0) / steps, "first_step_s": first}
    if cuda:
        out |= {"held_gib": base / 2**30, "temporary_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
    return out


def cpu_gpu_agreement() -> dict[str, float]:
    """Three steps of the same update on CPU and GPU: the share of weights equal to the bit, and moved at all."""
    import torch

    from asyncrl.actors.optimizer import StochasticAdamW

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3_000_001, generator=gen).bfloat16()
    g = (torch.randn(3_000_001, generator=gen) * 1e-3).bfloat16()
    out = []
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(w.clone().to(device))
        opt = StochasticAdamW([p], lr=1e-5, chunk_elements=1 << 20, seed=1)
        for _ in range(3):
            p.grad = g.to(device)
            opt.step()
        out.append(p.detach().cpu())
    return {"equal_fraction": (out[0] == out[1]).float().mean().item(),
            "moved_fraction": (out[1] != w).float().mean().item()}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--shape", default="qwen2.5-7b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args(argv)
    import torch

    from asyncrl.actors.optimizer import StochasticAdamW

    result = Result("optimizer", args, argv, module="bench.gpu.optimizer")
    out: dict[str, Any] = {"agreement": cpu_gpu_agreement()} if args.device == "cuda" else {}
    shapes = list(tensor_shapes(args.shape).values())
    out["params"] = sum(torch.Size(s).numel() for s in shapes)
    params = [torch.nn.Parameter(torch.randn(s, device=args.device, dtype=torch.bfloat16) * 0.02) for s in shapes]
    for x in params:
        x.grad = torch.randn_like(x) * 1e-3
    for name, compiled in (("adamw_bf16", False), ("adamw_bf16_compiled", True)):
        stochastic = StochasticAdamW(params, lr=1e-6, compiled=compiled)
        out[name] = {**timed(stochastic, args.steps, args.device),
                     "planned_temporary_gib": stochastic.temporary_bytes() / 2**30}
        print(out, flush=True)
        del stochastic
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out["torch_fused_adamw"] = timed(torch.optim.AdamW(params, lr=1e-6, fused=True), args.steps, args.device)
    out["step_ratio"] = out["adamw_bf16"]["step_s"] / out["torch_fused_adamw"]["step_s"]
    out["compiled_step_ratio"] = out["adamw_bf16_compiled"]["step_s"] / out["torch_fused_adamw"]["step_s"]
    out["compiled_speedup"] = out["adamw_bf16"]["step_s"] / out["adamw_bf16_compiled"]["step_s"]
    result.write(out, suffix=f"_{args.shape.replace('.', '')}")
    print(out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
