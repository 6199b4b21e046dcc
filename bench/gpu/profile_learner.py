"""Where a learner step's time goes: one ``LocalBackend`` step under ``torch.profiler``, the top operators by
device time and by CPU time, the step's wall time against its summed kernel time, and the kernel time by kind
(matrix multiplies, attention, the rest), written to ``learner_profile_<device>_<variant>.json``.

    python -m bench.gpu.profile_learner --shape qwen2-0.5b --packing --micro-batch-tokens 16384 [--varlen]
        [--compile]

The matmul share gives a bound that no fusion of the rest can pass: the MFU the step would reach if only its
matrix multiplies took time (``mfu_matmul_bound``).
"""

from __future__ import annotations

import time
from typing import Any

from bench import common
from bench.gpu import learner_speed

GEMM_MARKERS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")
ATTENTION_MARKERS = ("flash", "fmha", "attention", "attn")


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    if any(m in name for m in ATTENTION_MARKERS):
        return "attention"
    return "matmul" if any(m in name for m in GEMM_MARKERS) else "other"


def by_kind(events: Any) -> dict[str, float]:
    """Seconds of device time per kernel kind (kernels only, so nothing is counted twice)."""
    from torch.autograd import DeviceType

    out = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            out[kind_of(e.key)] += e.self_device_time_total / 1e6
    return out


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from asyncrl.actors.training import forward_tokens

    args = learner_speed.parse_args()
    common.set_env()
    model = learner_speed.build(args)
    cfg = learner_speed.learner_config(args, learner_speed.variants(args)[0])
    backend = learner_speed.backend_for(model, cfg)
    vocab = model.config.vocab_size
    learner_speed.warm(args, backend, vocab)  # as the speed bench does
    torch.cuda.synchronize()
    groups = learner_speed.batch(args, vocab, 9)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        backend.train_step(groups, 9)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    kinds = by_kind(events)
    device = sum(kinds.values())
    print(f"step wall {wall:.3f}s, summed kernel time {device:.3f}s, by kind "
          + ", ".join(f"{k} {v:.3f}s ({100 * v / device:.0f}%)" for k, v in kinds.items()))
    print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    flops = 6 * sum(p.numel() for p in model.parameters()) * sum(forward_tokens(g) for g in groups)
    result = common.Result("learner_profile", args, module="bench.gpu.profile_learner")
    result.write(
        {"shape": args.shape, "step_wall_s": wall, "kernel_s": kinds, "kernel_total_s": device,
         "mfu": flops / wall / args.peak_flops, "mfu_matmul_bound": flops / kinds["matmul"] / args.peak_flops},
        suffix=learner_speed.suffix(args))


if __name__ == "__main__":
    main()
