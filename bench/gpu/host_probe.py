"""Host costs behind a GPU learner step, measured side by side in one run:

- a bf16 matmul's launch (host time per call, the device kept busy so calls queue) when every call has a new
  shape, against calls that repeat one shape: cuBLAS searches for a kernel once per shape;
- a small element-wise chain on CPU tensors of ``--cpu-elements`` (a row layout's scale), in torch with its
  default thread count, in torch on one thread, and in numpy.

    python -m bench.gpu.host_probe            # on a GPU host; writes host_probe_<device>.json
    python -m bench.gpu.host_probe --cpu-only # the CPU half anywhere
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from bench import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--calls", type=int, default=60, help="matmul launches per pattern")
    p.add_argument("--tokens", type=int, default=40000, help="rows of the matmul input (a micro-batch's tokens)")
    p.add_argument("--cpu-elements", type=int, default=43000)
    p.add_argument("--repeats", type=int, default=50, help="timed repeats of the CPU chain")
    p.add_argument("--cpu-only", action="store_true")
    return p.parse_args(argv)


def matmul_launch_us(rows: list[int]) -> float:
    """Mean host microseconds per ``x @ w.T`` launch (Qwen2-0.5B's MLP up projection), device busy."""
    import torch

    w = torch.randn(4864, 896, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(m, 896, device="cuda", dtype=torch.bfloat16) for m in rows]
    big = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    big @ big  # tens of milliseconds of queued work: the launches below are not throttled by the device
    t0 = time.perf_counter()
    for x in xs:
        x @ w.T
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * host / len(rows)


def matmuls(args: argparse.Namespace) -> dict[str, float]:
    n, base = args.calls, args.tokens
    widths = [base + 512 * (i % 16) + 3 for i in range(n)]  # 16 widths, none of them met before
    return {
        "new_shapes_us": matmul_launch_us([base + 7 * i + 1 for i in range(n)]),
        "one_shape_us": matmul_launch_us([base] * n),
        # the same calls twice: the first pass meets each width once, the second only known shapes
        "16_widths_first_pass_us": matmul_launch_us(widths),
        "16_widths_again_us": matmul_launch_us(widths),
    }


def chain_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e6 * (time.perf_counter() - t0) / repeats


def cpu_ops(args: argparse.Namespace) -> dict[str, Any]:
    """``repeat(arange(n)[:128], n // 128) + arange(n)``: the kind of index maths a row layout does."""
    import numpy as np
    import torch

    n, reps = args.cpu_elements, args.repeats
    t, a = torch.arange(n), np.arange(n)
    per = n // 128

    def torch_chain() -> object:
        return torch.repeat_interleave(t[:128], per) + t[: 128 * per]

    threads = torch.get_num_threads()
    out = {"torch_threads": threads, "torch_default_threads_us": chain_us(torch_chain, reps)}
    torch.set_num_threads(1)
    out["torch_one_thread_us"] = chain_us(torch_chain, reps)
    torch.set_num_threads(threads)
    out["numpy_us"] = chain_us(lambda: np.repeat(a[:128], per) + a[: 128 * per], reps)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = common.Result("host_probe", args, argv, module="bench.gpu.host_probe")
    results: dict[str, Any] = {"cpu_ops": cpu_ops(args)}
    if not args.cpu_only:
        results["matmul_launch"] = matmuls(args)
    print(results, flush=True)
    result.write(results)


if __name__ == "__main__":
    main()
