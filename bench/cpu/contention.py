"""How much colocated training slows vLLM's generation on this machine, and the learner beside it.

    python -m bench.cpu.contention            # 3 rounds
    python -m bench.cpu.contention --quick    # 1 round

Explains ``async_vs_sync``'s gap to its ideal on a small CPU: the ideal assumes generation and training each run
at their solo speed when they overlap. Same engine and model as ``async_vs_sync`` (hidden 256, 4 layers,
``--max-num-seqs 16``); one measurement = ``--groups`` groups of 8 completions of 64 tokens (``ignore_eos``),
8 groups in flight. Per round, in this order:

- ``alone``: generation with nothing else running;
- ``learner_thread``: beside a training loop in a thread of this process, as ``Pipeline.run`` trains
  (forward + backward + AdamW over 64 sequences of 80 tokens, 1 torch thread);
- ``learner_thread_nice19``: the same loop at nice 19, so vLLM's processes and the event loop win every
  contest for a core;
- ``memory_stream``: beside a process pinned to the core vLLM's worker is not on, at nice 19, copying a
  64 MiB tensor over and over (no compute; it only shares caches and memory bandwidth).

Keys: ``gen_ratio_<setting>`` = tokens/s beside it / tokens/s alone (mean over rounds; alone is measured at
the start and end of each round), ``learner_step_s_alone`` / ``learner_step_s_beside_generation`` and
their ratio ``learner_slowdown``. A ratio below 1 is capacity an overlapped pipeline loses even with perfect
scheduling. Other load on the machine shifts every figure; the load average is in the result file.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import common

SETTINGS = ("learner_thread", "learner_thread_nice19", "memory_stream")
STREAM_CODE = """
import os, sys, torch
torch.set_num_threads(1)
os.sched_setaffinity(0, {int(sys.argv[1])})
os.setpriority(os.PRIO_PROCESS, 0, 19)
a = torch.randn(16 * 2**20); b = torch.empty_like(a)
print("ready", flush=True)
while True:
    b.copy_(a)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="one round")
    p.add_argument("--rounds", type=int, help="rounds of every setting (default 3, quick 1)")
    p.add_argument("--groups", type=int, default=24, help="groups of 8 x 64 tokens per measurement")
    p.add_argument("--seed", type=int, default=0)
    common.add_engine_flags(p, max_num_seqs=16)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    return args


class TrainingLoop:
    """Forward + backward + AdamW steps of ``model`` on fixed random tokens in a thread until stopped (or
    ``max_steps``), the thread ``nice`` nicer than the process, as ``LearnerConfig(nice=...)`` makes it."""

    def __init__(self, model: Any, nice: int = 0, max_steps: int | None = None) -> None:
        self.model, self.nice, self.max_steps = model, nice, max_steps
        self.steps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="contention-learner", daemon=True)

    def __enter__(self) -> TrainingLoop:
        self._thread.start()
        return self

    def join(self) -> None:
        """Wait for a loop started with ``max_steps`` to finish them."""
        self._thread.join()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import torch

        from asyncrl.actors.learner import lower_thread_priority

        lower_thread_priority(self.nice)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-7)
        tokens = torch.randint(0, self.model.config.vocab_size, (64, 80), generator=torch.Generator().manual_seed(0))
        while not self._stop.is_set() and (self.max_steps is None or len(self.steps) < self.max_steps):
            t0 = time.perf_counter()
            self.model(input_ids=tokens).logits.float().logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.steps.append(time.perf_counter() - t0)


async def generate(engine: Any, prompts: list[Any], groups: int, tag: str) -> float:
    """Tokens per second for ``groups`` groups, 8 in flight."""
    import asyncrl

    params = asyncrl.SamplingConfig(n=8, max_tokens=64, ignore_eos=True)
    slots = asyncio.Semaphore(8)

    async def one(i: int) -> int:
        async with slots:
            samples = await engine.generate(prompts[i % len(prompts)].token_ids, params, request_id=f"{tag}-{i}")
            return sum(len(s.token_ids) for s in samples)

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(groups))))
    return tokens / (time.perf_counter() - t0)


async def beside_stream(engine: Any, prompts: list[Any], groups: int, tag: str, core: int) -> float:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", STREAM_CODE, str(core),
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        await proc.stdout.readline()  # "ready": the tensors exist, the copy loop is starting
        return await generate(engine, prompts, groups, tag)
    finally:
        proc.kill()
        await proc.wait()


def learner_solo_step_s(model: Any, steps: int = 6) -> float:
    """The training loop's step time with nothing else running (vLLM idle)."""
    with TrainingLoop(model, max_steps=steps) as loop:
        loop.join()
    return statistics.median(loop.steps[1:])


def worker_core() -> int | None:
    """The one core vLLM's CPU worker is bound to, if it is bound to exactly one."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            cores = child.cpu_affinity() if child.name() == "VLLM::Worker" else []
            if len(cores) == 1:
                return cores[0]
        except psutil.Error:
            continue
    return None


async def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.engines.vllm_local import VLLMEngine

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = await asyncio.to_thread(common.load_learner, model_dir, "float32")  # once: every loop trains it
    prompts = [p for p, _ in zip(common.arithmetic_prompts(tok, args.seed), range(64))]
    engine = await VLLMEngine.start(common.engine_config(args, model_dir, 128, args.seed))
    rates: dict[str, list[float]] = {"alone": [], **{s: [] for s in SETTINGS}}
    beside_steps: list[float] = []
    try:
        await generate(engine, prompts, 2, "warm-up")
        core = worker_core()
        other = next((c for c in sorted(os.sched_getaffinity(0)) if c != core), 0)  # 1 core: share it
        for r in range(args.rounds):
            rates["alone"].append(await generate(engine, prompts, args.groups, f"alone-{r}"))
            for nice, name in ((0, "learner_thread"), (19, "learner_thread_nice19")):
                with TrainingLoop(model, nice) as loop:
                    rates[name].append(await generate(engine, prompts, args.groups, f"{name}-{r}"))
                if nice == 0:
                    beside_steps += loop.steps[1:]
            rates["memory_stream"].append(await beside_stream(engine, prompts, args.groups, f"stream-{r}", other))
            rates["alone"].append(await generate(engine, prompts, args.groups, f"alone-end-{r}"))
            print(f"  round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()) + " tok/s", flush=True)
    finally:
        await engine.close()
    solo = await asyncio.to_thread(learner_solo_step_s, model)
    alone = statistics.mean(rates["alone"])
    out: dict[str, Any] = {"tokens_per_s": rates, "worker_core": core, "stream_core": other}
    for name in SETTINGS:
        out[f"gen_ratio_{name}"] = statistics.mean(rates[name]) / alone
    beside = statistics.median(beside_steps) if beside_steps else float("nan")
    out.update(learner_step_s_alone=solo, learner_step_s_beside_generation=beside, learner_slowdown=beside / solo)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_env()
    import torch

    import asyncrl

    torch.set_num_threads(1)
    result = common.Result("contention", args, argv, module="bench.cpu.contention")
    model_dir = common.build_model("async-vs-sync-h256-l4", common.qwen_spec(256, 4, context=256, seed=args.seed))
    res = asyncrl.run(run(args, model_dir))
    print("generation beside it / alone: " + ", ".join(f"{s} {res[f'gen_ratio_{s}']:.2f}" for s in SETTINGS)
          + f"; learner step {res['learner_step_s_alone']:.2f}s alone, "
          f"{res['learner_step_s_beside_generation']:.2f}s beside generation ({res['learner_slowdown']:.2f}x)",
          flush=True)
    result.write(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
