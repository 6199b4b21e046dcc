"""Where a learner step's time goes: one ``LocalBackend`` step under ``torch.profiler``, the top operators by
device time and by CPU time, and the step's wall time against its summed kernel time.

    python -m bench.gpu.profile_learner --shape qwen2-0.5b [--packing] [--micro-batch-rollouts 16]
"""

from __future__ import annotations

import time

from bench.gpu import learner_speed


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from asyncrl.actors.training import LocalBackend
    from asyncrl.algorithms.losses import GRPOLoss, LossConfig
    from asyncrl.config import LearnerConfig

    args = learner_speed.parse_args()
    model = learner_speed.build(args)
    cfg = LearnerConfig(micro_batch_rollouts=args.micro_batch_rollouts, micro_batch_tokens=args.micro_batch_tokens,
                        packing=args.packing, gradient_checkpointing=args.grad_ckpt)
    backend = LocalBackend(model, torch.optim.AdamW(model.parameters(), lr=1e-6), GRPOLoss(LossConfig()), cfg)
    vocab = model.config.vocab_size
    for s in range(2):
        backend.train_step(learner_speed.batch(args, vocab, s), s)
    torch.cuda.synchronize()
    groups = learner_speed.batch(args, vocab, 9)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        backend.train_step(groups, 9)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    device = sum(e.self_device_time_total for e in events) / 1e6
    print(f"step wall {wall:.3f}s, summed kernel time {device:.3f}s")
    print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
