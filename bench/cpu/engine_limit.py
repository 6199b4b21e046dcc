"""How close does the full pipeline get to the engine's own generation speed?

    python -m bench.cpu.engine_limit            # 4 measured phases of 32 groups (8 x 128 tokens each)
    python -m bench.cpu.engine_limit --quick    # 4 phases of 16 groups

Same engine, same run, identical requests. Phases alternate (raw, pipe, raw, pipe, ...) after a warm-up:

- raw: ``--max-inflight`` workers each take a prompt and send its ``n`` requests straight to
  ``engine.llm.generate`` (the AsyncLLM) as a plain vLLM user would: n=1 per request, logprobs=0 and vLLM's
  defaults otherwise (it detokenises), ``ignore_eos=True`` so every completion has exactly ``--max-tokens``
  tokens;
- pipe: producers -> rollout queue -> Learner over the same prompts, same ``n``, ``max_tokens`` and number of
  groups in flight. The learner consumes every batch with a no-op loss (a zero loss with a gradient on a
  dummy parameter) and never publishes (``SyncConfig(every=10**9)``), so the engine is never paused. The
  producers run with the library's defaults: the (constant) reward is scored in a worker thread.

With ``--rollout-log DIR`` each pair gains a third phase, ``pipe_log``: the same pipeline writing the rollout log
(``PipelineConfig.rollout_log``) into ``DIR/phase-N``; ``log_ratio`` = its tokens/s over the plain pipe's (the
issue's bound: the log costs <= 3%, ``log_ratio >= 0.97``).

``ratio`` = pipeline tokens/s over raw tokens/s, summed over phases (= sum of raw times / sum of pipe times,
since the token counts are equal). Target >= 0.97. ``main_cpu_us_per_token[_raw]``: CPU time of this process
(event loop, vLLM's output handling, the learner and reward threads) per generated token, in each kind of phase:
on a 2-core host every such microsecond is taken from vLLM's worker. The model (hidden 512, 4 layers by default) is
big enough for the engine to be the bottleneck, so the ratio measures the pipeline's own overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import sys
import time
from pathlib import Path
from typing import Any

from bench import common

log = logging.getLogger("bench.cpu.engine_limit")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="16 groups per phase instead of 32")
    p.add_argument("--groups", type=int, help="groups (prompts) per phase (default 32, quick 16)")
    p.add_argument("--pairs", type=int, default=4, help="(raw, pipe) pairs measured (two pairs swung the ratio by 3%%)")
    p.add_argument("--n", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-inflight", type=int, default=8, help="groups in flight (raw workers / producer slots)")
    p.add_argument("--batch-groups", type=int, default=4, help="groups per learner batch")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rollout-log", type=Path, metavar="DIR",
                   help="also measure the pipeline writing the rollout log here (a pipe_log phase per pair)")
    common.add_engine_flags(p, max_num_seqs=64)
    args = p.parse_args(argv)
    args.groups = args.groups or (16 if args.quick else 32)
    return args


# ------------------------------------------------------------------------------------------------- raw


def sampling_params(engine: Any, max_tokens: int) -> Any:
    """A plain vLLM request for one sample with its log-prob (vLLM's defaults: detokenised, dict log-probs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stamps = hasattr(engine.llm, "update_weight_version")  # vLLM 0.32+: final-only outputs carry versions
    return SamplingParams(n=1, max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=None, logprobs=0,
                          ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY if stamps else RequestOutputKind.DELTA)


_request_ids = itertools.count()


async def raw_phase(engine: Any, prompts: list[Any], args: argparse.Namespace) -> tuple[int, float]:
    """Generate every prompt's group straight through the AsyncLLM. Returns (tokens, seconds)."""
    sp = sampling_params(engine, args.max_tokens)
    todo = iter(prompts)
    tokens = 0

    async def one(ids: list[int]) -> int:
        count = 0
        async for out in engine.llm.generate({"prompt_token_ids": ids}, sp, request_id=f"raw-{next(_request_ids)}"):
            comp = out.outputs[0]
            count = len(comp.token_ids) if sp.output_kind.name == "FINAL_ONLY" else count + len(comp.token_ids)
        return count

    async def worker() -> None:
        nonlocal tokens
        for prompt in todo:
            ids = list(prompt.token_ids)
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(ids)) for _ in range(args.n)]
            tokens += sum(t.result() for t in tasks)

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(args.max_inflight):
            tg.create_task(worker())
    return tokens, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ pipe


class NoOpLoss:
    """A zero loss with a gradient on the model's (dummy) parameter: the learner consumes, nothing trains."""

    min_group_size = 1  # any group will do: nothing is learned from it anyway

    def compute(self, model: Any, groups: Any, **kw: Any) -> Any:
        from asyncrl.algorithms.losses import LossOutput

        param = next(model.parameters())
        return LossOutput(loss=(param * 0.0).sum(), metrics={}, num_tokens=sum(g.num_tokens for g in groups))

    def inert(self, group: Any) -> bool:
        return False  # the role's default (torch is imported only once a pipeline runs, so no subclass here)


async def pipe_phase(engine: Any, prompts: list[Any], args: argparse.Namespace,
                     log_dir: Path | None = None) -> tuple[int, float, dict]:
    """Run the whole pipeline over ``prompts`` (writing the rollout log into ``log_dir``, if given). Returns
    (tokens, seconds, queue figures)."""
    import torch

    import asyncrl
    from asyncrl.groups import RewardGroups
    from asyncrl.recipes import grpo_pipeline

    b = args.batch_groups
    config = asyncrl.PipelineConfig(
        progress=False,  # a benchmark's output stays its own
        producer=asyncrl.ProducerConfig(
            sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens, ignore_eos=True),
            max_inflight_groups=args.max_inflight),
        queue=asyncrl.QueueConfig(capacity=max(2 * b, args.max_inflight), max_staleness=10**6),
        learner=asyncrl.LearnerConfig(batch_groups=b, sync=asyncrl.SyncConfig(every=10**9)),
        rollout_log=None if log_dir is None else asyncrl.RolloutLogConfig(log_dir),
    )
    dummy = torch.nn.Linear(1, 1, bias=False)
    pipeline = grpo_pipeline(engine, dummy, prompts, RewardGroups(lambda prompt, sample: 0.0), config, loss=NoOpLoss(),
                             close_engine=False)
    t0 = time.perf_counter()
    result = await pipeline.run(len(prompts) // b)
    seconds = time.perf_counter() - t0
    if result.groups_trained != len(prompts) or result.unaccounted:
        raise RuntimeError(f"pipeline trained {result.groups_trained} of {len(prompts)} groups "
                           f"(unaccounted {result.unaccounted}, dropped {result.dropped})")
    queue = pipeline.receiver.statistics()
    return result.tokens_generated, seconds, {"steps": result.steps, "queue_max_depth": queue.max_depth,
                                              "learner_wait_s": queue.receive_wait_s}


# ------------------------------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.engines.vllm_local import VLLMEngine

    if args.groups % args.batch_groups:
        raise SystemExit(f"--groups ({args.groups}) must be a multiple of --batch-groups ({args.batch_groups})")
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    kinds = ("raw", "pipe", "pipe_log") if args.rollout_log else ("raw", "pipe")
    prompts = list(common.arithmetic_prompts(tok, args.seed, limit=args.groups * (len(kinds) * args.pairs + 2)))
    chunks = [prompts[i: i + args.groups] for i in range(0, len(prompts), args.groups)]
    longest = max(len(p.token_ids) for p in prompts)
    engine = await VLLMEngine.start(common.engine_config(args, model_dir, common.context_len(longest + args.max_tokens),
                                                         args.seed))
    phases: list[dict[str, Any]] = []
    try:
        b = args.batch_groups
        warm = b * -(-max(b, args.max_inflight) // b)  # one full round of in-flight groups, whole batches
        t0 = time.perf_counter()
        await raw_phase(engine, chunks[0][:warm], args)
        await pipe_phase(engine, chunks[1][:warm], args)
        print(f"warm-up done in {time.perf_counter() - t0:.1f}s", flush=True)
        for i in range(args.pairs):
            for kind in kinds:
                chunk = chunks[2 + len(kinds) * i + kinds.index(kind)]
                cpu0 = time.process_time()
                if kind == "raw":
                    tokens, seconds = await raw_phase(engine, chunk, args)
                    extra: dict[str, Any] = {}
                else:
                    log_dir = args.rollout_log / f"phase-{i}" if kind == "pipe_log" else None
                    tokens, seconds, extra = await pipe_phase(engine, chunk, args, log_dir)
                cpu_us = (time.process_time() - cpu0) / tokens * 1e6  # this process: the event loop and threads
                phases.append({"kind": kind, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                               "main_cpu_us_per_token": cpu_us, **extra})
                print(f"  {kind:>8} {i}: {tokens} tokens in {seconds:.2f}s = {tokens / seconds:,.0f} tok/s, "
                      f"{cpu_us:.1f} us of this process's CPU per token", flush=True)
    finally:
        await engine.close()
    raw = [p for p in phases if p["kind"] == "raw"]
    pipe = [p for p in phases if p["kind"] == "pipe"]
    raw_rate = sum(p["tokens"] for p in raw) / sum(p["seconds"] for p in raw)
    pipe_rate = sum(p["tokens"] for p in pipe) / sum(p["seconds"] for p in pipe)
    cpu = {kind: sum(p["main_cpu_us_per_token"] * p["tokens"] for p in ps) / sum(p["tokens"] for p in ps)
           for kind, ps in (("raw", raw), ("pipe", pipe))}
    out = {"ratio": pipe_rate / raw_rate, "target": 0.97, "meets_target": pipe_rate / raw_rate >= 0.97,
           "raw_tokens_per_s": raw_rate, "pipe_tokens_per_s": pipe_rate,
           "main_cpu_us_per_token_raw": cpu["raw"], "main_cpu_us_per_token": cpu["pipe"],
           "pair_ratios": [p["tokens_per_s"] / r["tokens_per_s"] for r, p in zip(raw, pipe)],
           "params": common.param_count(model_dir), "phases": phases}
    logged = [p for p in phases if p["kind"] == "pipe_log"]
    if logged:
        log_rate = sum(p["tokens"] for p in logged) / sum(p["seconds"] for p in logged)
        out.update(log_tokens_per_s=log_rate, log_ratio=log_rate / pipe_rate,
                   log_pair_ratios=[q["tokens_per_s"] / p["tokens_per_s"] for p, q in zip(pipe, logged)])
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_env()
    logging.basicConfig(level=logging.WARNING)
    import torch

    import asyncrl

    torch.set_num_threads(1)  # the no-op learner needs none; keep it off the engine's core
    result = common.Result("engine_limit", args, argv, module="bench.cpu.engine_limit")
    model_dir = common.build_model(f"engine-limit-h{args.hidden}-l{args.layers}",
                                   common.qwen_spec(args.hidden, args.layers, context=512, seed=args.seed))
    print(f"model: {common.param_count(model_dir) / 1e6:.1f}M params, {args.groups} groups x {args.n} x "
          f"{args.max_tokens} tokens per phase, {args.max_inflight} groups in flight", flush=True)
    res = asyncrl.run(run(args, model_dir))
    print(f"raw {res['raw_tokens_per_s']:,.0f} tok/s, pipeline {res['pipe_tokens_per_s']:,.0f} tok/s: "
          f"ratio {res['ratio']:.3f} (target >= 0.97: {'met' if res['meets_target'] else 'NOT met'}; per pair "
          f"{', '.join(f'{r:.3f}' for r in res['pair_ratios'])})", flush=True)
    if "log_ratio" in res:
        print(f"with the rollout log {res['log_tokens_per_s']:,.0f} tok/s: {res['log_ratio']:.3f} of the plain "
              f"pipeline (per pair {', '.join(f'{r:.3f}' for r in res['log_pair_ratios'])})", flush=True)
    result.write(res, suffix="_rollout_log" if args.rollout_log else "")  # beside the plain run's file
    return 0


if __name__ == "__main__":
    sys.exit(main())
