"""A realistic GRPO workload on the GPU, ours and TRL's side by side: trained samples/s and tokens/s at equal
samples, with the long-tailed completion lengths of real reasoning traces.

    python -m bench.gpu.workload                            # one H200: gpu_workload_h200.json
    python -m bench.gpu.workload --layout 2gpu              # two H200s: gpu_workload_h200x2.json
    python -m bench.gpu.workload --cpu-smoke --out /tmp/w   # tiny shapes on CPU: the code paths, no figures

Task (``bench.gpu.countdown``): prompts of 100-300 tokens, 8 completions each, whose right answers have lognormal
lengths (mean ~256, max 1000 tokens + end-of-sequence; ``--max-tokens`` 1024), reward verifiable from the text.
The policy is a Qwen2-0.5B-shaped model (``--shapes`` also takes ``qwen2-1.5b``), randomly initialised, then
warm-started briefly on the GPU by supervised training on the task (``--warm-start-steps``), so that both sides
start from the same policy, which produces the lengths itself. Built and warm-started in their own processes,
cached by recipe under ``.cache/bench/gpu-workload``. The 7-8B shapes (``qwen2.5-7b``, ``llama3.1-8b``) are planted
instead (``bench.gpu.planted``: the task written into the weights, no training), with longer answers where asked
(``--max-answer`` up to 4,096, ``--mean-answer``); ``bench/gpu/run_7b.sh`` runs them.

Each side trains ``--steps`` optimiser steps of ``--batch-groups`` prompts x ``--n`` completions (equal samples),
from the same prompts in the same order, GRPO without KL, clip 0.2/0.28, token-mean loss, constant learning rate,
float32 weights under bf16 autocast, vLLM in bf16 with CUDA graphs and torch.compile (vLLM's defaults on both
sides; ``--no-engine-compile`` keeps graphs but skips the compile for ours), every group trained on.

Layout ``1gpu`` (everything colocated on GPU 0):
- ``async``: ours, ``Pipeline.run``: producers keep ``--inflight-batches`` batches of groups in flight while the
  learner trains, publications every step in the background (max staleness ``--max-staleness``);
- ``sync``: ours, ``Pipeline.run_synchronous`` on the same engine, which sleeps (``VLLMEngineConfig.sleep``,
  ``--sleep-level``) during every learner step and wakes weights -> update -> KV cache;
- ``async_fp8`` (only when named in ``--sides``): ``async`` again on a second engine serving the same bf16
  checkpoint in FP8 (``VLLMEngineConfig.quantization="fp8"``, vLLM's online quantization; publications requantize);
  the learner stays in bf16 autocast, and the per-step mismatch it sees at equal versions (``loss/mismatch_kl``,
  ``loss/mismatch_cut_frac``) is recorded beside the staleness;
- ``async_lora`` / ``sync_lora`` (only when named): ``async`` and ``sync`` on an engine serving adapters, the learner
  training a LoRA adapter (``--lora-rank``, ``--lora-alpha``, ``--lora-lr``) on its frozen base
  (``--lora-base-dtype``; with ``--share-base``, the engine's own weights, mapped: ``asyncrl.lora.share_base``),
  published alone; the engine never sleeps;
- ``alone_lora`` (only when named): that engine by itself at the producers' concurrency, serving an adapter of
  zeros, no learner: the most tokens/s any side on it can generate, so its ratio to ``sync_lora``'s trained
  tokens/s bounds what ``async_lora`` can gain (``generation_limit_ratio_lora``: async's generation over it);
- ``trl`` / ``trl_sleep``: TRL's ``GRPOTrainer`` with ``vllm_mode="colocate"``, without and with
  ``vllm_enable_sleep_mode`` (``bench.peers.trl_side``); ``trl_lora`` (only when named): the same with PEFT LoRA of
  our adapter's rank, alpha, targets and learning rate on a bf16 base.
Layout ``2gpu`` (engine on GPU 1, learner on GPU 0):
- ``alone``: the engine by itself at the producers' concurrency (tokens/s), then ``async`` as above; their ratio
  ``generation_limit_ratio`` = engine tokens/s during training over the engine alone;
- ``trl_async``: TRL's ``AsyncGRPOTrainer`` against ``vllm serve`` on GPU 1 (``bench.peers.trl_async_side``).

Per run: ``samples_per_s`` (trained samples over the training wall time; start-up reported apart), the same over
the steps after the first ``--skip-steps`` (``samples_per_s_steady``: the pipeline's fill left out),
``completion_tokens_per_s`` (tokens of the trained completions), mean completion length, peak GPU memory in use
on each device (sampled by this process: everything on the device, all processes), the learner's model FLOPs
utilisation (``bench.gpu.mfu``), per step the memory plan's prediction beside the measured peak
(``--memory-budget-gib``), and vLLM's generated-token counter sampled through the run (``engine_tokens_s``:
``bench.gpu.engine_share`` splits it by the learner's steps). Results are written after
every side, so a run cut short by its time limit keeps what it measured; ``--deadline-s`` skips sides that would
not fit (recorded as skipped).

verl is not compared here: it runs on Ray with its own dependency set, and the H200 host has neither, reaches no
package registry, and takes only a few tens of MiB of extra packages beside vLLM (Ray's wheel alone is ~70 MB).
Compare with verl's published figures on paper instead; no verl figure is produced or estimated here.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import common
from bench.gpu import countdown
from bench.gpu.engine_share import TokenClock
from bench.gpu.memory import MemoryWatch, free_gpu, watch
from bench.gpu.workload_rates import describe, rates, summarise
from bench.gpu.mfu import FlopCount
from bench.gpu.workload_task import add_task_args, max_model_len, prepare_model, task_prompts
from bench.peers import workload_trl

SIDES = {"1gpu": ("async", "sync", "trl", "trl_sleep"), "2gpu": ("alone", "async", "trl_async")}
OPTIONAL_SIDES = ("async_fp8", "alone_lora", "async_lora", "sync_lora", "trl_lora")  # run only when named
# Our sides by engine: each variant starts its own engine (full weights, FP8 weights, LoRA serving).
VARIANTS = {"": ("alone", "async", "sync"), "fp8": ("async",), "lora": ("alone", "async", "sync")}
SIDE_NEEDS_S = {"async": 60, "sync": 90, "alone": 30, "trl": 120, "trl_sleep": 120, "trl_async": 150,
                "async_fp8": 150, "alone_lora": 60, "async_lora": 150, "sync_lora": 90, "trl_lora": 240}
EXIT_GRACE_S = 30
# A side that repeats one measured earlier in the run, on an engine of another precision, takes about as long as
# its twin: it is expected to need the twin's wall time and a quarter again, plus the grace to write, rather than
# the table's figure, which must hold for every shape.
TWINS = {"async_fp8": "async"}
log = logging.getLogger("bench.gpu.workload")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--layout", choices=list(SIDES), default="1gpu")
    p.add_argument("--shapes", default="qwen2-0.5b",
                   help="comma-separated: qwen2-0.5b, qwen2-1.5b (warm-started); qwen2.5-7b, llama3.1-8b (planted)")
    p.add_argument("--sides", default="", help="comma-separated subset of the layout's sides (default: all)")
    p.add_argument("--steps", type=int, default=None, help="optimiser steps a side (default 8; the CPU smoke run 2)")
    p.add_argument("--skip-steps", type=int, default=2, help="first steps left out of the steady-state rate")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--admission", action=argparse.BooleanOptionalAction, default=True,
                   help="staleness-aware admission and start-order consumption (QueueConfig.admission)")
    p.add_argument("--correction", default="truncate", help="LossConfig.correction: truncate, mask or m2po")
    p.add_argument("--learner", choices=("fast", "padded"), default="fast",
                   help="ours: fast = packed rows, varlen attention, compiled decoder layers, micro-batches of "
                        "--micro-batch-tokens (compiled once before the timed run); padded = 8-rollout padded rows")
    p.add_argument("--micro-batch-tokens", type=int, default=65536)
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="fast learner: compile the decoder layers (--no-compile-layers: eager, same rows)")
    p.add_argument("--inflight-batches", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-start-steps", type=int, default=0, help="0: the shape's default")
    p.add_argument("--warm-batch", type=int, default=16)
    p.add_argument("--warm-lr", type=float, default=3e-4)
    p.add_argument("--kv-cache-gib", type=float, default=8.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--engine-compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sleep-level", type=int, choices=(1, 2), default=2, help="ours, sync side")
    p.add_argument("--trl-python", default=sys.executable, help="the interpreter TRL is importable in")
    p.add_argument("--trl-path", action="append", default=[],
                   help="directories put first on TRL's PYTHONPATH (its wheels); this process's PYTHONPATH follows")
    p.add_argument("--trl-gpu-memory-utilization", type=float, default=0.12, help="TRL colocate's vLLM share")
    p.add_argument("--trl-timeout", type=int, default=480)
    p.add_argument("--deadline-s", type=float, default=0, help="skip sides that would end past this (0: none)")
    p.add_argument("--tag", default="", help="appended to the result file's name (gpu_workload_h200_TAG.json)")
    p.add_argument("--resume", action="store_true",
                   help="continue the result file of the same name: its whole sides are kept, not run again, and "
                        "a side cut short (partial) runs again (a run too long for one command goes on in the "
                        "next, on the same machine: each side records it)")
    p.add_argument("--learner-dtype", default="float32", help="the learner's weights (full fine-tuning)")
    p.add_argument("--optimizer", choices=("adamw", "adamw_bf16"), default="adamw",
                   help="LearnerConfig.optimizer (adamw_bf16 for bf16 weights)")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="LearnerConfig.memory_budget_gib")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--lora-alpha", type=int, default=64)
    p.add_argument("--lora-lr", type=float, default=2e-5, help="the adapter's learning rate (LoRA sides)")
    p.add_argument("--lora-base-dtype", default="bfloat16", help="the frozen base's dtype on the LoRA sides")
    p.add_argument("--share-base", action="store_true",
                   help="LoRA sides: the learner maps the engine's weights as its frozen base "
                        "(asyncrl.lora.share_base) instead of holding its own copy")
    add_task_args(p)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU: prove the code paths run")
    args = p.parse_args(argv)
    if args.cpu_smoke:  # tiny shapes only: "tiny" (warm-started) or "tiny-untied" (planted)
        args.shapes = ",".join(s for s in args.shapes.split(",") if s.startswith("tiny")) or "tiny"
        args.steps, args.skip_steps, args.batch_groups, args.n = args.steps or 2, 1, 2, 4
        args.max_tokens, args.kv_cache_gib, args.max_num_seqs, args.lr, args.warm_lr = 48, 1.0, 16, 1e-4, 1e-3
        args.learner_dtype = args.lora_base_dtype = "float32"  # the CPU engine's precision
    args.steps = args.steps or 8
    args.sides = args.sides.split(",") if args.sides else list(SIDES[args.layout])
    return args


# ------------------------------------------------------------------------------------------------------ ours


def pipeline_config(args: argparse.Namespace, synchronous: bool, lr: float | None = None) -> Any:
    import asyncrl

    b = args.batch_groups
    return asyncrl.PipelineConfig(
        progress=False,  # a benchmark's output stays its own
        producer=asyncrl.ProducerConfig(sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens),
                                        max_inflight_groups=b if synchronous else b * args.inflight_batches),
        queue=asyncrl.QueueConfig(capacity=b * max(1, args.max_staleness),
                                  max_staleness=0 if synchronous else args.max_staleness, admission=args.admission),
        learner=asyncrl.LearnerConfig(batch_groups=b, lr=lr or args.lr, micro_batch_rollouts=args.n,
                                      skip_inert_groups=False, autocast=None if args.cpu_smoke else "bfloat16",
                                      sync=asyncrl.SyncConfig(mode="keep", overlap=not synchronous),
                                      memory_budget_gib=args.memory_budget_gib, **learner_speed_options(args),
                                      **({"optimizer": args.optimizer} if args.optimizer != "adamw" else {})),
    )


def learner_speed_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.learner == "padded":
        return {}
    return {"packing": True, "varlen_attention": not args.cpu_smoke,
            "compile_layers": args.compile_layers and not args.cpu_smoke, "micro_batch_tokens": args.micro_batch_tokens}


def throwaway_twin(model: Any) -> Any:
    """A copy of ``model`` to compile and warm up on: its trainable parameters copied (their gradients and updates
    stay the twin's), its frozen ones shared. A LoRA policy's base is never copied: 14.2 GiB at 7B, which on a lent
    base (``--share-base``) would put a second base on the GPU after all."""
    import copy

    return copy.deepcopy(model, memo={id(p): p for p in model.parameters() if not p.requires_grad})


def precompile_learner(args: argparse.Namespace, model: Any, cfg: Any) -> float:
    """Seconds spent compiling the learner's layers and head (and ``adamw_bf16``'s update) before the timed run,
    on throwaway copies (compiled code is shared by every instance of a module class, and of the optimiser)."""
    if not cfg.compiled:
        return 0.0
    import torch

    from asyncrl.actors.training import LocalBackend
    from asyncrl.algorithms.losses import GRPOLoss, LossConfig

    t0 = time.perf_counter()
    twin = throwaway_twin(model)
    backend = LocalBackend(twin, torch.optim.SGD(twin.parameters(), lr=0.0), GRPOLoss(LossConfig()), cfg)
    groups = common.synthetic_groups(args.batch_groups, args.n, 200, (20, args.max_tokens), model.config.vocab_size, 0)
    common.warm_up_learner(backend, groups)
    del backend, twin
    if cfg.optimizer == "adamw_bf16":  # its compiled update too, on a throwaway parameter (dynamic shapes)
        from asyncrl.actors.optimizer import StochasticAdamW

        device = next(model.parameters()).device
        scratch = torch.nn.Parameter(torch.zeros(1 << 20, dtype=torch.bfloat16, device=device))
        scratch.grad = torch.ones_like(scratch)
        StochasticAdamW([scratch], compiled=True).step()
    free_gpu()
    return time.perf_counter() - t0


def engine_config(args: argparse.Namespace, model_dir: Path, lora: Any = None, quantization: str | None = None
                  ) -> Any:
    """Our engine; with ``lora`` (a ``LoraConfig``), serving adapters of its rank (and never sleeping); with
    ``quantization``, serving the checkpoint quantized so (only the async side runs on it: it never sleeps)."""
    from asyncrl.engines.lora.transport import LoraServingConfig
    from asyncrl.engines.vllm_local import VLLMEngineConfig

    gpu = common.on_gpu() and not args.cpu_smoke
    sleeps = args.layout == "1gpu" and "sync" in args.sides and lora is None and quantization is None
    return VLLMEngineConfig(model=str(model_dir), dtype="bfloat16" if gpu else "float32", quantization=quantization,
                            max_model_len=max_model_len(args), max_num_seqs=args.max_num_seqs,
                            kv_cache_gib=args.kv_cache_gib, enforce_eager=not gpu, torch_compile=args.engine_compile,
                            seed=args.seed, sleep=args.sleep_level if sleeps else 0,
                            lora=None if lora is None else LoraServingConfig.holding(lora.rank))


@contextmanager
def engine_devices(args: argparse.Namespace) -> Any:
    """2gpu: the engine's processes see GPU 1 first (theirs) and GPU 0 (the learner's, whose CUDA IPC weight
    snapshots they open); this process has initialised CUDA with both visible before, so it is unaffected."""
    if args.layout != "2gpu" or args.cpu_smoke:
        yield
        return
    import torch

    torch.cuda.init()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = "1,0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


async def one_run(args: argparse.Namespace, engine: Any, model_dir: Path, tok: Any, prompts: list[Any],
                  synchronous: bool, memory: MemoryWatch, lora: Any = None, lr: float | None = None,
                  progress: Any = None) -> dict[str, Any]:
    """One pipeline run; with ``lora`` (a ``LoraConfig``) the policy trains an adapter alone, published alone.
    ``progress`` is handed the steps so far after every step (``partial``: a side cut short by a command's time
    limit keeps what it measured)."""
    from asyncrl.algorithms.losses import LossConfig
    from asyncrl.groups import RewardGroups
    from asyncrl.recipes import grpo_pipeline

    shared = lora is not None and args.share_base  # the base stays on the host until mapped onto the engine's
    model = common.load_learner(model_dir, dtype=args.learner_dtype if lora is None else args.lora_base_dtype,
                                device="cpu" if shared else None)
    base_shared_gib = 0.0
    if lora is not None:
        from asyncrl.lora import apply_lora, share_base

        model = apply_lora(model, lora)
        if shared:
            base_shared_gib = share_base(model, await engine.lend_base()) / 2**30
    config = pipeline_config(args, synchronous, lr)
    learner_memory = common.LearnerMemory()
    precompile_s = precompile_learner(args, model, config.learner)
    print(f"learner precompiled in {precompile_s:.0f}s", flush=True)
    pipe = grpo_pipeline(engine, model, prompts, RewardGroups(lambda p, s: countdown.reward(s.text, p.answer)),
                         config, pad_id=tok.pad_token_id, close_engine=False,
                         loss_config=LossConfig(clip_low=0.2, clip_high=0.28, length_norm="token_mean",
                                                correction=args.correction))
    per_step = args.batch_groups * args.n
    marks, tokens, rewards = [], [], []
    series: dict[str, list[float]] = {k: [] for k in PER_STEP}
    t0 = time.perf_counter()
    clock = TokenClock(t0)

    def hook(step: int, m: dict[str, float]) -> None:
        marks.append(time.perf_counter() - t0)
        tokens.append(m.get("train/completion_len_mean", 0.0) * per_step)
        rewards.append(m.get("train/reward_mean", float("nan")))
        for key, metric in PER_STEP.items():
            series[key].append(m.get(metric, float("nan")))
        print(f"step {step} ends at {marks[-1]:.1f}s", flush=True)  # a run cut short still shows its pace
        if progress is not None:
            progress({**rates(marks, per_step, tokens, marks[-1], args.skip_steps), "partial": True,
                      "mode": "sync" if synchronous else "async", "rewards": rewards, **series,
                      "engine_tokens_s": samples_of(clock)})

    pipe.learner.hooks.append(hook)
    flops = FlopCount(model, lora=lora is not None)
    pipe.learner.recorder = flops  # the workload keeps no rollout log: the recorder slot is free
    counters = getattr(engine, "sleep_counters", None)
    before = (counters.sleep_s, counters.wake_s) if counters else (0.0, 0.0)
    with memory.watching(), learner_memory:
        async with clock:
            result = await (pipe.run_synchronous if synchronous else pipe.run)(args.steps)
    wall = time.perf_counter() - t0
    pauses = [t.total_s for t in pipe.learner.weight_sync.history]
    out = rates(marks, per_step, tokens, wall, args.skip_steps)
    out.update(mode="sync" if synchronous else "async", rewards=rewards, **series, **flops.report(result.train_s),
               host=common.host_id(), behaviour_precision=engine.behaviour_precision.describe(),
               tokens_generated=result.tokens_generated,
               generated_tokens_per_s=result.tokens_generated / wall, learner_train_s=result.train_s,
               gen_s=result.gen_s, sync_paused_s=result.sync_s, sleep_s=result.sleep_s, dropped=result.dropped,
               unaccounted=result.unaccounted, gpu_peak_used_gib=list(memory.peak), learner_precompile_s=precompile_s,
               learner_options=learner_speed_options(args),
               staleness_mean=common.staleness_mean(pipe.receiver.statistics().staleness),
               publication_pause_s={"mean": sum(pauses) / len(pauses), "max": max(pauses), "count": len(pauses)}
               if pauses else None, learner_peak_allocated_gib=learner_memory.peak_gib,
               trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
               engine_tokens_s=samples_of(clock), base_shared_gib=base_shared_gib, **token_books(pipe, result))
    if counters:
        out["engine_sleep_s"], out["engine_wake_s"] = counters.sleep_s - before[0], counters.wake_s - before[1]
    del model, pipe
    free_gpu()
    return out


def samples_of(clock: TokenClock) -> list[list[float]]:
    """The clock's samples (seconds, tokens, requests running) as the result file keeps them."""
    return [[round(t, 2), c, r] for t, c, r in clock.samples]


# Per-step series a side records, from the learner's metrics: the mismatch at equal versions (precision, not
# staleness) and the memory plan's prediction beside the measured peak.
PER_STEP = {"mismatch_kl": "loss/mismatch_kl", "mismatch_cut_frac": "loss/mismatch_cut_frac",
            "memory_predicted_gib": "learner/memory_predicted_gib", "memory_peak_gib": "learner/memory_peak_gib",
            "learner_step_s": "learner/train_s"}


def token_books(pipe: Any, result: Any) -> dict[str, Any]:
    """Completion tokens generated (reaching the queue), trained and dropped by reason, and the generated
    against the trained mean length: the length-bias and waste figures of the run."""
    queue = pipe.receiver.metrics()
    counters = pipe.learner.counters
    samples = sum(p.counters.samples for p in pipe.producers)
    return {"tokens_trained": counters.tokens_trained,
            "tokens_dropped": {k.removeprefix("tokens/dropped_"): v for k, v in queue.items()
                               if k.startswith("tokens/dropped_")},
            "generated_len_mean": result.tokens_generated / samples if samples else 0.0,
            "trained_len_mean": counters.tokens_trained / counters.samples_trained if counters.samples_trained else 0.0,
            "admission": pipe.config.queue.admission, "correction": pipe.learner.loss.cfg.correction.value}


async def engine_alone(args: argparse.Namespace, engine: Any, prompts: list[Any],
                       adapter: Any = None) -> dict[str, Any]:
    """The engine by itself: the same groups at the producers' concurrency, nothing else running. ``adapter`` (an
    ``AdapterWeights``) is published first, so a LoRA engine's bound pays the adapter's kernels as async does."""
    import asyncrl

    if adapter is not None:
        await asyncrl.publish(engine, adapter)
    params = asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens)
    gate = asyncio.Semaphore(args.batch_groups * args.inflight_batches)
    groups = prompts[: args.steps * args.batch_groups]

    async def one(i: int, p: Any) -> int:
        async with gate:
            return sum(len(s.token_ids) for s in await engine.generate(p.token_ids, params, f"alone-{i}"))

    t0 = time.perf_counter()
    async with TokenClock(t0) as clock:
        tokens = sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(groups))))
    wall = time.perf_counter() - t0
    return {"groups": len(groups), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "adapter": adapter is not None, "engine_tokens_s": samples_of(clock), "host": common.host_id()}


def zero_adapter(model_dir: Path, lora: Any) -> Any:
    """An adapter of zeros shaped per ``lora`` for the checkpoint in ``model_dir`` (built on the meta device, no
    weights read): the adapter's kernels at their full cost, the base model's outputs. PEFT starts ``B`` at zero,
    so it is also the policy the learner starts from."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.engines.updates import AdapterWeights
    from asyncrl.lora.model import adapter_config, adapter_state, apply_lora

    with torch.device("meta"):
        model = apply_lora(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)), lora)
    tensors = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in adapter_state(model).items()}
    return AdapterWeights(tensors, adapter_config(model))


async def ours(args: argparse.Namespace, model_dir: Path, report: Report, out: dict[str, Any], variant: str) -> None:
    """Our sides of ``variant`` (``VARIANTS``) on one engine, started once, into ``out``: ``alone`` first where
    asked, then ``async``, then ``sync``. ``fp8``: an engine serving the checkpoint in FP8 (``async_fp8``);
    ``lora``: an engine serving adapters, and a learner training one on a frozen base (``async_lora``,
    ``sync_lora``: the engine never sleeps)."""
    from transformers import AutoTokenizer

    import asyncrl
    from asyncrl.engines.vllm_local import VLLMEngine
    from asyncrl.lora import LoraConfig

    suffix = f"_{variant}" if variant else ""
    todo = [s for s in VARIANTS[variant]  # a side cut short earlier runs again, whole
            if s + suffix in args.sides and (s + suffix not in out or out[s + suffix].get("partial"))]
    # An engine that would start only to find no time left for its sides is not started: it is expected to take
    # as long as the run's earlier engine did.
    earlier_start = max((v for k, v in out.items() if k.startswith("engine_start_s")), default=0.0)
    if not any(report.time_left_for(s + suffix, out, engine_start_s=earlier_start) for s in todo):
        for s in todo:
            report.skip(s + suffix)
        return
    lora = LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha) if variant == "lora" else None
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = task_prompts(args, tok, args.steps * args.batch_groups * 3)  # room for groups dropped as stale
    t0 = time.perf_counter()
    with engine_devices(args):
        engine = await VLLMEngine.start(engine_config(args, model_dir, lora=lora,
                                                      quantization="fp8" if variant == "fp8" else None))
    out["engine_start_s" + suffix] = time.perf_counter() - t0
    print(f"engine{suffix} up in {out['engine_start_s' + suffix]:.0f}s", flush=True)
    try:
        t1 = time.perf_counter()
        probe = prompts[-1]  # the first request pays one-off costs; its completions show the starting policy
        first = await engine.generate(probe.token_ids, asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens),
                                      "warm-up")
        out["first_request" + suffix] = {"s": time.perf_counter() - t1, "expected_length": probe.answer,
                                         "lengths": [len(s.token_ids) for s in first],
                                         "rewards": [countdown.reward(s.text, probe.answer) for s in first]}
        report()
        for side in todo:
            key = side + suffix
            if not report.fits(key, out):
                continue
            memory = watch(args)
            if side == "alone":
                out[key] = await engine_alone(args, engine, prompts,
                                              zero_adapter(model_dir, lora) if lora is not None else None)
                await engine.llm.reset_prefix_cache()  # the runs after it start without its prompts cached
            else:
                def progress(partial: dict[str, Any], key: str = key) -> None:
                    out[key] = partial
                    report()

                out[key] = await one_run(args, engine, model_dir, tok, prompts, side == "sync", memory, lora=lora,
                                         lr=args.lora_lr if lora else None, progress=progress)
            if "alone" + suffix in out and "async" + suffix in out:
                out["generation_limit_ratio" + suffix] = (out["async" + suffix]["generated_tokens_per_s"]
                                                          / out["alone" + suffix]["tokens_per_s"])
            report()
    finally:
        await engine.close()
        free_gpu()


# ------------------------------------------------------------------------------------------------------ main


class Report:
    """Writes the result file after every side; says whether a side still fits before ``--deadline-s``. With
    ``--resume``, starts from the file of the same name: its sides stay, and its header is kept under
    ``continues``."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.result = common.Result("gpu_workload", args, argv, module="bench.gpu.workload")
        self.results: dict[str, Any] = {}
        self.skipped: list[str] = []
        suffix = "x2" if args.layout == "2gpu" and common.device_suffix() != "cpu" else ""
        self.suffix = suffix + (f"_{args.tag}" if args.tag else "")
        earlier = self.result.path(self.suffix)
        if args.resume and earlier.exists():
            doc = json.loads(earlier.read_text())
            self.results = {k: v for k, v in doc["results"].items() if k != "summary"}
            keep = ("date", "command", "hardware", "total_s", "continues")
            self.result.doc["continues"] = [{k: doc.get(k) for k in keep}]

    def time_left_for(self, side: str, measured: dict[str, Any] | None = None, engine_start_s: float = 0.0) -> bool:
        """Whether ``side`` would end before ``--deadline-s``: what it needs (its twin's time in ``measured``, the
        sides measured so far, else ``SIDE_NEEDS_S``), after ``engine_start_s`` for an engine still to start."""
        twin = (measured or {}).get(TWINS.get(side, ""))
        done = twin and "wall_s" in twin and not twin.get("partial")
        need = 1.25 * twin["wall_s"] + EXIT_GRACE_S if done else SIDE_NEEDS_S[side]
        return not self.args.deadline_s or time.perf_counter() - self.t0 + engine_start_s + need < self.args.deadline_s

    def fits(self, side: str, measured: dict[str, Any] | None = None) -> bool:
        """``time_left_for(side, measured)``, recording the side as skipped when there is not."""
        if self.time_left_for(side, measured):
            return True
        self.skip(side)
        return False

    def skip(self, side: str) -> None:
        self.skipped.append(side)
        print(f"skipping {side}: it would not end before --deadline-s {self.args.deadline_s:.0f}", flush=True)

    def peer_timeout(self) -> float:
        """``--trl-timeout``, cut to end EXIT_GRACE_S before ``--deadline-s``: the peer is killed and what it ran is
        written before whatever enforces the deadline kills this process."""
        if not self.args.deadline_s:
            return self.args.trl_timeout
        left = self.args.deadline_s - (time.perf_counter() - self.t0) - EXIT_GRACE_S
        return max(1.0, min(self.args.trl_timeout, left))

    def __call__(self) -> None:
        summary = summarise(self.results)
        self.result.write({"summary": summary, **self.results}, suffix=self.suffix, skipped=self.skipped)


async def run_shape(args: argparse.Namespace, shape: str, report: Report) -> None:
    entry: dict[str, Any] = report.results.setdefault(shape, {})
    model_dir, warm = prepare_model(args, shape)
    entry.setdefault("warm_start", warm)
    print(f"[{shape}] {warm['params'] / 1e6:.0f}M params, warm start {warm}", flush=True)
    report()
    mine = entry.setdefault("ours", {})
    for variant, sides in VARIANTS.items():
        try:
            await ours(args, model_dir, report, mine, variant)
        except Exception as exc:  # recorded; the other sides still run
            log.exception("our side failed")
            mine["error" + (f"_{variant}" if variant else "")] = f"{type(exc).__name__}: {exc}"
            report()
        for side in sides:
            r = mine.get(side + (f"_{variant}" if variant else ""))
            if r:
                print(f"[{shape}] ours {side}{'_' + variant if variant else ''}: {describe(r)}", flush=True)
    for side in ("trl", "trl_sleep", "trl_async", "trl_lora"):
        if side in args.sides and (side not in entry or entry[side].get("partial")) and report.fits(side):
            try:
                entry[side] = await workload_trl.run_side(args, model_dir, side, report.peer_timeout())
            except Exception as exc:
                log.exception("%s failed", side)
                entry[side] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{shape}] {side}: {describe(entry[side])}", flush=True)
            report()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_env()
    logging.basicConfig(level=logging.WARNING)
    import asyncrl

    report = Report(args, argv)
    for shape in args.shapes.split(","):
        asyncrl.run(run_shape(args, shape, report))
    report()
    print("summary:", {k: round(v, 3) for k, v in summarise(report.results).items()}, flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written. An exit that hangs (once at 7B, after the sync side, until the command's limit) ends
    # after EXIT_GRACE_S with every thread's stack on stderr, and exit status 1, rather than spend the GPU's time.
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)
    sys.exit(code)
