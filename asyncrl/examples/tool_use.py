"""Tool use with multi-turn GRPO: a tiny model learns to call a calculator for products it cannot compute.

    python -m asyncrl.examples.tool_use                    # build, warm-start, RL (a few minutes on a 2-core CPU)
    python -m asyncrl.examples.tool_use --steps 20 --out runs/tool_quick

The task is ``a*b=`` with two-digit operands, far beyond what a 2-layer character-level model learns to
multiply in minutes. The model may instead write ``<calc>a*b</calc>``: its turn ends at the ``</calc>`` token,
the environment runs the calculator (a plain async function, with a timeout) and appends ``<res>product</res>``
as environment tokens; the model's next turn is its answer. A turn without a call is the final answer, and the
environment rewards an exact one with 1.0. Tool markers are single tokens, as ``<tool_call>`` is in chat models.

The supervised warm start teaches the format on a mix: ``--warm-tool-frac`` of its examples use the tool, the
rest answer directly (and mostly wrongly: the model cannot multiply). So RL starts from a policy that calls the
tool sometimes; GRPO on whole episodes (the loss masks out environment tokens) raises the tool-call rate and
with it the held-out accuracy. Accuracy is measured greedily through the same episode runner.

The task, the calculator and the call format live in ``asyncrl/examples/calculator.py``.

Writes into ``--out``: ``metrics.jsonl`` (one row per learner step, ``episode/*`` gauges included),
``tool_use.png``, ``summary.json`` and ``base/`` (the warm-started model).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.examples import common, sft, tracking
from asyncrl.examples.calculator import (CALL, END_CALL, END_RES, RES, TOOL_TOKENS, CalculatorProtocol,
                                 multiplication_task)

log = logging.getLogger("asyncrl.examples.tool_use")



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/tool_use"), help="run directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-out", type=int, default=200, help="held-out problems for evaluation")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=800, help="supervised warm-start steps (batch 64)")
    p.add_argument("--warm-tool-frac", type=float, default=0.25, help="share of warm-start examples using the tool")
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=100, help="learner steps")
    p.add_argument("--n", type=int, default=8, help="episodes per prompt (group size)")
    p.add_argument("--batch-groups", type=int, default=16, help="groups per learner step")
    p.add_argument("--turn-tokens", type=int, default=10, help="model tokens per turn at most")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--pause-mode", choices=("keep", "abort", "wait"), default="keep")
    p.add_argument("--eval-every", type=int, default=20, help="held-out eval every K steps (0 = off)")
    p.add_argument("--tensorboard", choices=("auto", "on", "off"), default="off")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ warm start


def demonstration(tok: Any, ex: common.Example, use_tool: bool) -> tuple[list[int], list[int]]:
    """Token ids of one solved episode and its labels (-100 on the prompt and on environment tokens)."""
    a, b = ex.prompt.rstrip("=").split("*")
    segments = [(f"{CALL}{a}*{b}{END_CALL}", True), (f"{RES}{ex.answer}{END_RES}", False)] if use_tool else []
    ids = list(common.encode_prompt(tok, ex.prompt))
    labels = [-100] * len(ids)
    for text, trained in [*segments, (ex.answer, True)]:
        seg = tok(text, add_special_tokens=False).input_ids
        ids += seg
        labels += seg if trained else [-100] * len(seg)
    return ids + [tok.eos_token_id], labels + [tok.eos_token_id]


def warm_start(model_dir: Path, task: common.Task, steps: int, tool_frac: float, lr: float, seed: int,
               progress: bool = True, batch: int = 64) -> dict[str, Any]:
    """Teacher forcing on a mix of tool-using and direct demonstrations; the model is saved in place."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0, loss = time.perf_counter(), float("nan")
    model.train()
    for _ in tqdm(range(steps), desc="warm start", unit="step", disable=not progress, leave=False):
        rows = [demonstration(tok, rng.choice(task.train), rng.random() < tool_frac) for _ in range(batch)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for i, (row, lab) in enumerate(rows):
            ids[i, : len(row)], labels[i, : len(lab)] = torch.tensor(row), torch.tensor(lab)
            attention[i, : len(row)] = 1
        out = model(input_ids=ids, attention_mask=attention, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss = float(out.loss.detach())
    model.save_pretrained(str(model_dir))
    return {"steps": steps, "tool_frac": tool_frac, "final_loss": loss, "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------ evaluation


class GreedySampler:
    """A ``Sampler`` decoding greedily on a ``VLLMEngine`` (``SamplingConfig`` refuses temperature 0), so the
    evaluation runs through the same ``EpisodeRunner`` as training."""

    def __init__(self, engine: Any, tok: Any) -> None:
        self.engine, self.tok, self.name = engine, tok, f"{engine.name}-greedy"

    version = property(lambda self: self.engine.version)
    max_model_len = property(lambda self: self.engine.max_model_len)
    vocab_size = property(lambda self: self.engine.vocab_size)

    async def generate(self, prompt_ids: tuple[int, ...], params: Any, request_id: str, n: int | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from asyncrl.types import FinishReason, Sample, VersionSpan

        sp = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, detokenize=False,
                            stop_token_ids=list(params.stop_token_ids), output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.engine.llm.generate({"prompt_token_ids": list(prompt_ids)}, sp, request_id=request_id):
            final = out.outputs[0]
        ids = tuple(final.token_ids)
        return [Sample(ids, (0.0,) * len(ids), FinishReason(final.finish_reason),
                       (VersionSpan(self.version, 0, len(ids)),), self.tok.decode(ids, skip_special_tokens=True))]


async def evaluate(engine: Any, tok: Any, task: common.Task, producer_config: Any, tag: str) -> dict[str, float]:
    """Greedy held-out accuracy (``accuracy``) and the share of episodes that called the tool (``tool_rate``)."""
    from asyncrl.episodes import EpisodeRunner

    protocol = CalculatorProtocol(tok)
    runner = EpisodeRunner(GreedySampler(engine, tok), protocol.env_factory(task.reward), producer_config)
    prompts = [_prompt(tok, ex, f"{tag}-{i}") for i, ex in enumerate(task.held_out)]
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(runner.run(p, p.prompt_id)) for p in prompts]
    episodes = [t.result() for t in tasks]
    return {"accuracy": sum(e.env_reward for e in episodes) / len(episodes),
            "tool_rate": sum(e.tool_calls > 0 for e in episodes) / len(episodes)}


def _prompt(tok: Any, ex: common.Example, prompt_id: str) -> Any:
    from asyncrl import Prompt

    return Prompt(prompt_id, common.encode_prompt(tok, ex.prompt), str(ex.prompt), ex.answer)


class EvalHook:
    """Every ``every`` learner steps, greedy held-out accuracy and tool-call rate as ``eval/*`` metrics."""

    def __init__(self, engine: Any, tok: Any, task: common.Task, producer_config: Any, every: int) -> None:
        self.engine, self.tok, self.task, self.cfg, self.every = engine, tok, task, producer_config, every
        self.seconds = 0.0
        self._count = itertools.count()

    async def evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        result = await evaluate(self.engine, self.tok, self.task, self.cfg, f"eval{next(self._count)}")
        self.seconds += time.perf_counter() - t0
        return result

    async def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if self.every > 0 and step % self.every == 0:
            result = await self.evaluate()
            metrics["eval/accuracy"], metrics["eval/tool_rate"] = result["accuracy"], result["tool_rate"]


# ------------------------------------------------------------------------------------------------- run


def producer_config(args: argparse.Namespace, tok: Any) -> Any:
    import asyncrl

    end_call = tok.convert_tokens_to_ids(END_CALL)
    return asyncrl.ProducerConfig(
        sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.turn_tokens, temperature=args.temperature,
                                        stop_token_ids=(end_call,)),
        max_inflight_groups=args.batch_groups,
        episode=asyncrl.EpisodeConfig(max_turns=args.max_turns, max_episode_tokens=args.max_turns * 16,
                                      max_env_tokens=12, env_timeout_s=10.0),
    )


def pipeline_config(args: argparse.Namespace, tok: Any) -> Any:
    import asyncrl

    return asyncrl.PipelineConfig(
        producer=producer_config(args, tok),
        queue=asyncrl.QueueConfig(capacity=common.queue_capacity(args.batch_groups, args.max_staleness),
                                  max_staleness=args.max_staleness),
        learner=asyncrl.LearnerConfig(batch_groups=args.batch_groups, lr=args.lr,
                                      micro_batch_rollouts=args.batch_groups * args.n,
                                      sync=asyncrl.SyncConfig(mode=args.pause_mode)),
    )


def prepare_model(args: argparse.Namespace, task: common.Task) -> tuple[Path, dict[str, Any]]:
    """A tiny character-level model with the tool tokens, warm-started in ``out/base``."""
    base = args.out / "base"
    shutil.rmtree(base, ignore_errors=True)
    sft.build_char_model(base, task, args.hidden, args.layers, args.seed, added_tokens=TOOL_TOKENS)
    info = warm_start(base, task, args.warm_steps, args.warm_tool_frac, args.warm_lr, args.seed,
                      progress=not args.no_progress)
    print(f"warm start: {info['steps']} SFT steps in {info['seconds']:.0f}s (loss {info['final_loss']:.3f})",
          flush=True)
    return base, info


async def main(args: argparse.Namespace, task: common.Task, model_dir: Path) -> dict[str, Any]:
    """Engine up -> evaluation before -> GRPO on episodes -> evaluation after. Always shuts the engine down."""
    from transformers import AutoTokenizer

    from asyncrl.algorithms.losses import LossConfig
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig
    from asyncrl.metrics import make_monitor
    from asyncrl.recipes import grpo_pipeline

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    (args.out / "metrics.jsonl").unlink(missing_ok=True)
    monitor = make_monitor(args.out, tensorboard=args.tensorboard, config=_jsonable(vars(args)))
    config = pipeline_config(args, tok)
    engine = await VLLMEngine.start(VLLMEngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=16 * (args.max_turns + 2), seed=args.seed,
        max_num_seqs=max(64, args.n * args.batch_groups), kv_cache_gib=args.kv_cache_gib))
    progress = None
    try:
        evals = EvalHook(engine, tok, task, config.producer, args.eval_every)
        before = await evals.evaluate()
        print(f"before RL: held-out greedy accuracy {before['accuracy']:.1%}, tool-call rate "
              f"{before['tool_rate']:.1%}", flush=True)
        prompts = (_prompt(tok, ex, f"train-{i}") for i, ex in _endless(task.train, args.seed))
        pipeline = grpo_pipeline(engine, _load_policy(model_dir), prompts, None, config,
                                 loss_config=LossConfig(), pad_id=tok.pad_token_id,
                                 monitor=monitor, close_engine=False,
                                 env=CalculatorProtocol(tok).env_factory(task.reward))
        progress = tracking.ProgressHook(args.steps, desc="GRPO (tool use)", disable=args.no_progress)
        pipeline.learner.hooks += [evals, progress]
        stats = await pipeline.run(args.steps)
        after = await evals.evaluate()
    finally:
        if progress is not None:
            progress.close()
        monitor.close()
        await engine.close()
    return {"before": before, "after": after, "eval_s": evals.seconds, "steps": stats.steps,
            "wall_s": stats.wall_s, "samples_trained": stats.samples_trained, "dropped": stats.dropped}


def _endless(items: Sequence[Any], seed: int) -> Any:
    rng = random.Random(seed)
    for _ in itertools.count():
        order = list(range(len(items)))
        rng.shuffle(order)
        yield from ((i, items[i]) for i in order)


def _load_policy(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


# ------------------------------------------------------------------------------------------------ report


def plot(rows: Sequence[dict[str, Any]], path: Path, before: dict[str, float], after: dict[str, float],
         steps: int) -> Path:
    """Reward and accuracy, tool use, environment time and tool errors, staleness and sync, per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    evals = [(0, before)] + [(r["step"], {"accuracy": r["eval/accuracy"], "tool_rate": r["eval/tool_rate"]})
                             for r in rows if "eval/accuracy" in r] + [(steps, after)]
    panels = [
        (axes[0, 0], {"train/reward_mean": "train reward (mean)"}, "accuracy", "held-out greedy accuracy",
         "reward / accuracy"),
        (axes[0, 1], {"episode/tool_call_rate": "tool-call rate (sampled, recent episodes)",
                      "episode/turns_mean": "turns per episode"}, "tool_rate", "held-out greedy tool-call rate",
         "tool use"),
        (axes[1, 0], {"episode/tool_errors_mean": "tool errors per episode",
                      "episode/truncated_frac": "truncated share"},
         None, None, "tool errors / truncation"),
        (axes[1, 1], {"rollout/staleness_batch_mean": "staleness (batch mean)", "sync/total_s": "sync (s)"},
         None, None, "staleness / weight sync"),
    ]
    for ax, series, eval_key, eval_label, title in panels:
        for key, label in series.items():
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if pts:
                ax.plot(*zip(*pts), label=label, alpha=0.8)
        if eval_key:
            ax.plot([s for s, _ in evals], [e[eval_key] for _, e in evals], "o-", label=eval_label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("learner step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(args: argparse.Namespace, result: dict[str, Any], warm: dict[str, Any], total_s: float) -> None:
    rows = tracking.read_jsonl(args.out / "metrics.jsonl")
    summary = {**result, "warm_start": warm, "total_s": total_s, "args": _jsonable(vars(args))}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    png = plot(rows, args.out / "tool_use.png", result["before"], result["after"], result["steps"])
    b, a = result["before"], result["after"]
    print(f"GRPO: {result['steps']} steps, {result['samples_trained']} episodes in {result['wall_s']:.0f}s; "
          f"dropped {result['dropped']}")
    print(f"held-out greedy accuracy: before {b['accuracy']:.1%} -> after {a['accuracy']:.1%}; "
          f"tool-call rate {b['tool_rate']:.1%} -> {a['tool_rate']:.1%}")
    print(f"run dir: {args.out}  (metrics.jsonl, {png.name}, summary.json); total {total_s:.0f}s")


def cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.start_cli(args.verbose, args.torch_threads)
    import asyncrl

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    task = multiplication_task(n_held_out=args.held_out, seed=args.seed)
    model_dir, warm = prepare_model(args, task)
    result = asyncrl.run(main(args, task, model_dir))
    report(args, result, warm, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(cli())
    except KeyboardInterrupt:
        print("\ninterrupted: run cancelled, engine shut down", file=sys.stderr)
        sys.exit(130)
