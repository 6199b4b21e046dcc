"""Asynchronous pipeline vs the synchronous baseline: trained samples per second, and the overlap bound.

    python -m bench.cpu.async_vs_sync           # 2 x (sync, async) runs of 24 steps
    python -m bench.cpu.async_vs_sync --quick   # 1 x (sync, async) of 14 steps

Same engine, model, task (addition prompts, exact-match reward), learner (GRPO, AdamW) and batch
(``--batch-groups`` groups of ``--n`` completions of ``--max-tokens`` tokens, ``ignore_eos`` so lengths are
fixed), both modes in the same process, alternating:

- sync: ``Pipeline.run_synchronous``: generate a batch, train on it, publish, repeat (nothing overlaps);
- async: ``Pipeline.run``: producers keep ``--batch-groups`` groups in flight while the learner trains on the
  previous batch (max staleness ``--max-staleness``, keep-mode pause for every publication, published in the
  background while the next step trains).

Both train on every group (``skip_inert_groups=False``): the random model earns almost no reward, and
skipping groups with equal rewards would remove the training phase being overlapped.

From the sync run's phase times (its ``RunResult``), T_gen = ``gen_s`` and T_train = ``train_s + sync_s``,
the ideal overlap bound is ``ideal = (T_gen + T_train) / max(T_gen, T_train)``. ``speedup`` is the async
over the sync trained samples/s in steady state (steps after ``--warm-steps``, so start-up and the
pipeline's fill are left out; whole-run figures are reported too); ``ratio_to_ideal = speedup / ideal``,
target >= 0.9. The model size (``--hidden``/``--layers``) and batch are chosen so T_gen and T_train are
comparable on a 2-core CPU (hidden 256, 4 layers; the engine's ``--max-num-seqs 16`` slows generation
to the learner's pace).

Per run the CPU used is recorded (cores used on average by the main process = event loop + learner thread,
vLLM's EngineCore and Worker, and by everything else on the machine); ``cpu_capacity_bound`` is the sync
runs' wall time over their CPU-seconds spread over all cores: the speed-up if our work were packed perfectly
onto the machine, which on 2 cores can be below ``ideal``.

On a 2-core CPU vLLM's worker is bound to core 0 and the learner shares core 1 with vLLM's front end and
the event loop; ``--torch-threads 1`` (default) keeps the learner's matmuls off the engine's core (with 2
threads each backward would steal core 0 from generation, slowing both), and the learner's thread runs at
nice 19 (``--learner-nice``) so vLLM's processes and the event loop preempt it. Even so, overlapped phases
run below their solo speed here (``python -m bench.cpu.contention``), which the ideal does not allow for. Other load on
the machine shifts every figure; the load average is in the result file.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common

log = logging.getLogger("bench.cpu.async_vs_sync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true", help="one pair of shorter runs")
    p.add_argument("--steps", type=int, help="learner steps per run (default 24, quick 14)")
    p.add_argument("--warm-steps", type=int, default=3, help="first steps left out of the steady-state rate")
    p.add_argument("--repeats", type=int, help="(sync, async) pairs (default 2, quick 1)")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=1, help="learner threads (CPU)")
    p.add_argument("--learner-nice", type=int, default=-1,
                   help="LearnerConfig.nice, both modes; -1 = 19 on CPU (generation keeps its pace beside "
                        "training, python -m bench.cpu.contention), 0 on GPU")
    p.add_argument("--seed", type=int, default=0)
    common.add_engine_flags(p, max_num_seqs=16)
    args = p.parse_args(argv)
    args.steps = args.steps or (14 if args.quick else 24)
    if args.learner_nice < 0:
        args.learner_nice = 0 if common.on_gpu() else 19
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.steps <= args.warm_steps + 1:
        p.error("--steps must exceed --warm-steps + 1")
    return args


def pipeline_config(args: argparse.Namespace, synchronous: bool) -> Any:
    import asyncrl

    b = args.batch_groups
    staleness = 0 if synchronous else args.max_staleness
    return asyncrl.PipelineConfig(
        progress=False,  # a benchmark's output stays its own
        producer=asyncrl.ProducerConfig(
            sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens, ignore_eos=True),
            max_inflight_groups=b),
        queue=asyncrl.QueueConfig(capacity=b, max_staleness=staleness),
        # Every group is trained on (a random model earns no reward, so skipping inert groups would remove
        # the training phase this benchmark overlaps); async publishes in the background.
        learner=asyncrl.LearnerConfig(batch_groups=b, lr=args.lr, micro_batch_rollouts=b * args.n,
                                      skip_inert_groups=False, nice=args.learner_nice,
                                      sync=asyncrl.SyncConfig(mode="keep", overlap=not synchronous)),
    )


async def one_run(engine: Any, model_dir: Path, tok: Any, args: argparse.Namespace, synchronous: bool,
                  seed: int) -> dict[str, Any]:
    from asyncrl.algorithms.losses import LossConfig
    from asyncrl.groups import RewardGroups
    from asyncrl.recipes import grpo_pipeline
    from asyncrl.testing.tasks import arithmetic

    model = common.load_learner(model_dir)
    pipeline = grpo_pipeline(
        engine, model, common.arithmetic_prompts(tok, seed),
        RewardGroups(lambda p, s: arithmetic.reward(s.text, p.answer)),
        pipeline_config(args, synchronous), loss_config=LossConfig(), pad_id=tok.pad_token_id,
        close_engine=False)
    marks: list[float] = []
    pipeline.learner.hooks.append(lambda step, metrics: marks.append(time.perf_counter()))
    cpu0 = cpu_snapshot()
    t0 = time.perf_counter()
    result = await (pipeline.run_synchronous if synchronous else pipeline.run)(args.steps)
    cpu = cpu_usage(cpu0, cpu_snapshot(), time.perf_counter() - t0)
    per_step = args.batch_groups * args.n
    k = args.warm_steps
    steady = (len(marks) - k) * per_step / (marks[-1] - marks[k - 1]) if len(marks) > k else float("nan")
    queue = pipeline.receiver.statistics()  # staleness of the groups handed to the learner
    return {
        "mode": "sync" if synchronous else "async", "steps": result.steps, "wall_s": time.perf_counter() - t0,
        "samples_trained": result.samples_trained, "samples_per_s": result.samples_per_s,
        "samples_per_s_steady": steady, "gen_s": result.gen_s, "train_s": result.train_s, "sync_s": result.sync_s,
        "tokens_generated": result.tokens_generated, "dropped": result.dropped, "unaccounted": result.unaccounted,
        "mean_staleness": common.staleness_mean(queue.staleness),
        "learner_wait_s": queue.receive_wait_s, "producer_put_wait_s": queue.send_wait_s,
        "cpu": cpu,
    }


def cpu_snapshot() -> dict[str, Any]:
    """CPU seconds of this process and of each vLLM process below it, and of the whole machine."""
    import psutil

    me = psutil.Process()
    procs: dict[str, float] = {"main (event loop + learner)": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            name = child.name()
            if name.startswith("VLLM::") or "python" not in name:
                procs[name] = procs.get(name, 0.0) + sum(child.cpu_times()[:2])
        except psutil.Error:
            continue
    t = psutil.cpu_times()
    return {"procs": procs, "busy": t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)
            + getattr(t, "steal", 0), "cores": psutil.cpu_count()}


def cpu_usage(a: dict[str, Any], b: dict[str, Any], wall: float) -> dict[str, Any]:
    """Cores used on average over ``wall`` seconds: ours per process, the machine, and everything else."""
    ours = {k: (b["procs"][k] - a["procs"].get(k, 0.0)) / wall for k in b["procs"]}
    machine = (b["busy"] - a["busy"]) / wall
    return {"cores_used_by": ours, "cores_used_ours": sum(ours.values()), "cores_used_machine": machine,
            "cores_used_others": machine - sum(ours.values()), "cores": b["cores"]}


async def run(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    import asyncrl
    from asyncrl.engines.vllm_local import VLLMEngine

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = await VLLMEngine.start(common.engine_config(args, model_dir, common.context_len(args.max_tokens + 16),
                                                         args.seed))
    runs = []
    try:
        warm = next(common.arithmetic_prompts(tok, 10**6))
        await engine.generate(warm.token_ids, asyncrl.SamplingConfig(n=args.n, max_tokens=args.max_tokens),
                              request_id="warm-up")  # the first request with logprobs costs ~2 s once
        for rep in range(args.repeats):
            for synchronous in (True, False):
                r = await one_run(engine, model_dir, tok, args, synchronous, seed=args.seed + rep)
                r["repeat"] = rep
                runs.append(r)
                print(f"  {r['mode']:>5} #{rep}: {r['samples_per_s_steady']:.1f} samples/s steady "
                      f"({r['samples_per_s']:.1f} whole run, {r['wall_s']:.0f}s); gen {r['gen_s']:.1f}s "
                      f"train {r['train_s']:.1f}s sync {r['sync_s']:.1f}s; staleness {r['mean_staleness']:.2f} "
                      f"dropped {r['dropped']}; cores used: ours {r['cpu']['cores_used_ours']:.2f} "
                      f"({', '.join(f'{k.split()[0]} {v:.2f}' for k, v in r['cpu']['cores_used_by'].items())}), "
                      f"others {r['cpu']['cores_used_others']:.2f}", flush=True)
    finally:
        await engine.close()
    return runs


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    sync = [r for r in runs if r["mode"] == "sync"]
    asyn = [r for r in runs if r["mode"] == "async"]
    t_gen = sum(r["gen_s"] for r in sync)
    t_train = sum(r["train_s"] + r["sync_s"] for r in sync)
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = statistics.mean(r["samples_per_s_steady"] for r in asyn) / statistics.mean(
        r["samples_per_s_steady"] for r in sync)
    speedup_wall = sum(r["samples_trained"] for r in asyn) / sum(r["wall_s"] for r in asyn) / (
        sum(r["samples_trained"] for r in sync) / sum(r["wall_s"] for r in sync))
    # All of our CPU work in the sync runs, packed perfectly onto the machine's cores: no overlap can beat it.
    sync_wall = sum(r["wall_s"] for r in sync)
    sync_core_s = sum(r["cpu"]["cores_used_ours"] * r["wall_s"] for r in sync)
    capacity = sync_wall / (sync_core_s / sync[0]["cpu"]["cores"])
    return {
        "speedup": speedup, "ideal": ideal, "cpu_capacity_bound": capacity, "ratio_to_ideal": speedup / ideal,
        "target_ratio_to_ideal": 0.9,
        "meets_target": speedup / ideal >= 0.9, "speedup_whole_run": speedup_wall,
        "ratio_to_ideal_whole_run": speedup_wall / ideal, "sync_T_gen_s": t_gen, "sync_T_train_s": t_train,
        "sync_samples_per_s_steady": statistics.mean(r["samples_per_s_steady"] for r in sync),
        "async_samples_per_s_steady": statistics.mean(r["samples_per_s_steady"] for r in asyn),
        "pair_speedups": [a["samples_per_s_steady"] / s["samples_per_s_steady"] for s, a in zip(sync, asyn)],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_env()
    logging.basicConfig(level=logging.WARNING)
    import torch

    import asyncrl

    if not common.on_gpu():
        torch.set_num_threads(args.torch_threads)
    result = common.Result("async_vs_sync", args, argv, module="bench.cpu.async_vs_sync")
    model_dir = common.build_model(f"async-vs-sync-h{args.hidden}-l{args.layers}",
                                   common.qwen_spec(args.hidden, args.layers, context=256, seed=args.seed))
    print(f"model {common.param_count(model_dir) / 1e6:.1f}M params; {args.steps} steps x {args.batch_groups} "
          f"groups x {args.n} x {args.max_tokens} tokens; torch threads {torch.get_num_threads()}", flush=True)
    res = summarise(asyncrl.run(run(args, model_dir)))
    print(f"sync T_gen {res['sync_T_gen_s']:.1f}s T_train {res['sync_T_train_s']:.1f}s -> ideal {res['ideal']:.2f}x "
          f"(2-core CPU capacity bound {res['cpu_capacity_bound']:.2f}x); "
          f"async speedup {res['speedup']:.2f}x steady ({res['speedup_whole_run']:.2f}x whole run): "
          f"ratio to ideal {res['ratio_to_ideal']:.2f} (target >= 0.9: {'met' if res['meets_target'] else 'NOT met'})",
          flush=True)
    result.write(res, torch_threads=torch.get_num_threads())
    return 0


if __name__ == "__main__":
    sys.exit(main())
