"""Watching and keeping an example run: held-out greedy accuracy (the library's ``asyncrl.Evaluator``, as a learner
hook and before / after training), the metrics sinks (``--tensorboard``, ``--wandb``), checkpoints and resuming
(``--checkpoint-dir``, ``--checkpoint-every``, ``--resume``), a learning-rate schedule, a tqdm progress bar, and
the run plots and closing lines. The examples share these, so one test covers each mechanism. A support module
(see ``common.py``): it imports ``common`` alone."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.data import encode_prompt
from asyncrl.examples.common import Example, RewardFn, Task


def held_out_prompts(tok: Any, problems: Sequence[Example]) -> list[Any]:
    """The held-out problems as ``asyncrl.Prompt`` (the answer rides along for the reward)."""
    from asyncrl import Prompt

    return [Prompt(f"held-out-{i}", tuple(encode_prompt(ex.prompt, tok)), ex.prompt if isinstance(ex.prompt, str)
                   else "", ex.answer) for i, ex in enumerate(problems)]


def text_reward(reward: RewardFn) -> Callable[[Any, Any], float]:
    """A task reward ``(completion text, answer)`` as a library ``RewardFn`` ``(prompt, sample)``."""
    return lambda prompt, sample: reward(sample.text, prompt.answer)


async def engine_greedy_accuracy(engine: Any, tok: Any, problems: Sequence[Example], reward: RewardFn,
                                 max_tokens: int, batch: str = "eval") -> float:
    """Held-out accuracy with greedy decoding on ``engine``'s current weights, beside any training requests
    (nothing is paused). ``batch`` is kept for callers; request ids are unique per evaluation anyway."""
    from asyncrl import Evaluator, RewardGroups, SamplingConfig
    from asyncrl.actors.evaluation import greedy

    evaluator = Evaluator(engine, held_out_prompts(tok, problems), RewardGroups(text_reward(reward)), every=0,
                          sampling=greedy(SamplingConfig(max_tokens=max_tokens)))
    return (await evaluator.evaluate())["eval/accuracy"]


class EvalHook:
    """Every ``every`` steps, held-out greedy accuracy on the engine as ``eval/accuracy`` (with the rest of the
    library ``Evaluator``'s ``eval/*``), and on demand (``evaluate``: before and after training).

    The learner waits for the evaluation (producers keep generating). ``seconds`` totals the time spent
    evaluating; ``points`` holds ``(step, accuracy, clock_s)`` where ``clock_s`` is the time since the hook was
    created minus the evaluation time before it, i.e. the training wall time at which the weights were measured.
    """

    def __init__(self, engine: Any, tok: Any, task: Task, max_tokens: int, every: int) -> None:
        from asyncrl import Evaluator, RewardGroups, SamplingConfig
        from asyncrl.actors.evaluation import greedy

        held_out = held_out_prompts(tok, task.held_out)
        self.evaluator = Evaluator(engine, held_out, RewardGroups(text_reward(task.reward)), every=every,
                                   sampling=greedy(SamplingConfig(max_tokens=max_tokens)))
        self.points: list[tuple[int, float, float]] = []
        self.t0 = time.perf_counter()

    @property
    def seconds(self) -> float:
        return self.evaluator.seconds

    async def evaluate(self, step: int) -> float:
        metrics: dict[str, float] = {}
        await self._measure(step, metrics, self.evaluator.evaluate())
        return metrics["eval/accuracy"]

    async def __call__(self, step: int, metrics: dict[str, float]) -> None:
        await self._measure(step, metrics, self.evaluator(step, metrics))

    async def _measure(self, step: int, metrics: dict[str, float], evaluation: Any) -> None:
        t0, spent, rounds = time.perf_counter(), self.seconds, self.evaluator.rounds
        result = await evaluation
        if result is not None:  # ``evaluate`` returns its metrics; the hook adds them itself
            metrics.update(result)
        if self.evaluator.rounds != rounds:
            self.points.append((step, metrics["eval/accuracy"], t0 - self.t0 - spent))


# ------------------------------------------------------------------------------------------ metrics sinks


def add_sink_args(group: Any, tensorboard: str = "auto") -> None:
    """``--tensorboard`` and ``--wandb`` (with ``--wandb-run-name``); ``metrics.jsonl`` is always written."""
    group.add_argument("--tensorboard", choices=("auto", "on", "off"), default=tensorboard,
                       help="TensorBoard event files in OUT/tensorboard (auto: if installed; "
                            "pip install 'asyncrl[tensorboard]')")
    group.add_argument("--wandb", metavar="PROJECT", help="log to this Weights & Biases project "
                                                          "(pip install 'asyncrl[wandb]')")
    group.add_argument("--wandb-run-name", metavar="NAME", help="the W&B run's name (default: W&B picks one)")


def open_monitor(args: argparse.Namespace, config: dict[str, Any]) -> Any:
    """The run's monitor, and one line saying which sinks it writes to."""
    from asyncrl.metrics import make_monitor

    monitor = make_monitor(args.out, tensorboard=args.tensorboard, wandb="on" if args.wandb else "off",
                           wandb_project=args.wandb or "asyncrl", wandb_run_name=args.wandb_run_name, config=config)
    print(f"metrics: {sinks_line(args)}", flush=True)
    return monitor


def sinks_line(args: argparse.Namespace) -> str:
    from asyncrl.metrics import optional_sinks

    tensorboard, wandb = optional_sinks(args.tensorboard, "on" if args.wandb else "off")
    parts = [str(args.out / "metrics.jsonl")]
    if tensorboard:
        parts.append(f"TensorBoard {args.out / 'tensorboard'}")
    elif args.tensorboard == "auto":
        parts.append("no TensorBoard (not installed: pip install 'asyncrl[tensorboard]')")
    if wandb:
        parts.append(f"W&B project {args.wandb}" + (f", run {args.wandb_run_name}" if args.wandb_run_name else ""))
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------ checkpoints


def add_checkpoint_args(group: Any) -> None:
    group.add_argument("--checkpoint-dir", type=Path, help="write checkpoints step-NNNNNN here (and --resume latest "
                                                           "reads them); the newest 3 are kept")
    group.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                       help="checkpoint every K learner steps (0 = never; needs --checkpoint-dir)")
    group.add_argument("--resume", metavar="DIR|latest",
                       help="continue from a checkpoint: a step-NNNNNN directory, a directory holding them (its "
                            "newest), or latest (the newest under --checkpoint-dir). --steps stays the total")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any slow start-up, flags that cannot work: a sink asked for whose package is missing, a
    checkpoint interval without a directory, ``--resume`` with nothing to resume from."""
    from asyncrl.metrics import optional_sinks

    try:
        optional_sinks(args.tensorboard, "on" if args.wandb else "off")
    except RuntimeError as exc:
        parser.error(str(exc))
    if args.checkpoint_every < 0 or (args.checkpoint_every and args.checkpoint_dir is None):
        parser.error("--checkpoint-every K needs K >= 0 and --checkpoint-dir")
    if args.resume == "latest" and args.checkpoint_dir is None:
        parser.error("--resume latest needs --checkpoint-dir")
    if args.resume is not None:
        try:
            args.resume = str(resume_point(args).path)  # found now: the run records the exact checkpoint
        except (OSError, RuntimeError, ValueError) as exc:
            parser.error(f"--resume {args.resume}: {exc}")


def resume_point(args: argparse.Namespace) -> Any:
    """The checkpoint ``--resume`` names (None without it); raises ``CorruptCheckpoint`` or ``FileNotFoundError``."""
    from asyncrl.checkpoint import latest, verify

    if args.resume is None:
        return None
    path = Path(args.checkpoint_dir if args.resume == "latest" else args.resume)
    if path.name.startswith("step-"):
        return verify(path)
    found = latest(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint under {path}")
    return found


async def build_pipeline(engine: Any, model: Any, source: Any, groups: Any, config: Any, *, checkpoint: Any,
                         checkpointer: Any, **kwargs: Any) -> Any:
    """``grpo_pipeline`` on ``source`` (a fresh ``PromptSource``), or, given ``checkpoint``, the pipeline continued
    from it (``asyncrl.checkpoint.resume_pipeline``): the step count, the prompt cursor, the weights
    (published to the engine), the optimiser state, the RNG states and the group books continue. Groups that were
    queued or being generated when the checkpoint was taken are not replayed: they count as dropped
    (``unused_at_shutdown``) and the prompts continue at the cursor. With ``checkpointer`` it checkpoints itself
    every ``--checkpoint-every`` steps (``checkpointer``, made by ``open_checkpointer(args)``)."""
    from asyncrl.checkpoint import checkpoint_hook, resume_pipeline
    from asyncrl.recipes import grpo_pipeline

    if checkpoint is None:
        pipeline = grpo_pipeline(engine, model, source, groups, config, **kwargs)
        if checkpointer is not None:
            pipeline.learner.hooks.append(checkpoint_hook(checkpointer, pipeline.learner, source))
        return pipeline
    # resume_pipeline positions the fresh source at the checkpoint's cursor (its epochs and seed kept).
    pipeline, _ = await resume_pipeline(engine, model, source, groups, config, checkpoint=checkpoint,
                                        checkpointer=checkpointer, **kwargs)
    print(f"resumed from {checkpoint.path}: step {checkpoint.step}, prompt cursor {checkpoint.meta['cursor']}, "
          f"weights published as version {pipeline.learner.version}", flush=True)
    return pipeline


def open_checkpointer(args: argparse.Namespace) -> Any:
    """A ``Checkpointer`` for ``--checkpoint-dir`` / ``--checkpoint-every`` (an ``async with`` block), or a
    no-op context when checkpoints are off."""
    import contextlib

    if not args.checkpoint_every:
        return contextlib.nullcontext()
    from asyncrl.checkpoint import CheckpointConfig, Checkpointer

    return Checkpointer(CheckpointConfig(dir=args.checkpoint_dir, every_steps=args.checkpoint_every))


def start_metrics(out: Path, checkpoint: Any) -> int:
    """Prepare ``out/metrics.jsonl`` and return the step the run starts from: a fresh run starts a new file; one
    resumed from ``checkpoint`` keeps the rows up to its step (later ones are trained again) and appends."""
    path = out / "metrics.jsonl"
    if checkpoint is None:
        path.unlink(missing_ok=True)
        return 0
    if path.exists():
        rows = [r for r in read_jsonl(path) if r["step"] <= checkpoint.step]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return checkpoint.step


def lr_schedule(optimizer: Any, warmup: int = 0, decay_to: int = 0,
                start: int = 0) -> Callable[[int, dict[str, float]], None]:
    """A learner hook shaping the learning rate: a linear ramp over the first ``warmup`` steps (Adam's first
    updates move every weight by about lr whatever the gradient, which can wreck a tiny policy at once), then,
    with ``decay_to`` > 0, a linear decay reaching 0 at step ``decay_to`` (a tiny policy's greedy answers flip
    from one step to the next; a vanishing step lets the last ones settle). ``start``: the learner's step when
    the hook is made (a resumed run), so the schedule continues where it was."""
    from torch.optim.lr_scheduler import LambdaLR

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return ramp * (max(0.0, 1.0 - step / decay_to) if decay_to else 1.0)

    # A restored optimiser keeps its ``initial_lr``, which LambdaLR scales from.
    schedule = LambdaLR(optimizer, lambda step: factor(step + start))
    return lambda step, metrics: schedule.step()


class ProgressHook:
    """A tqdm bar over learner steps: reward, staleness, trained/generated length, the share of tokens whose importance
    weight was cut, queue depth, last sync time, last accuracy."""

    def __init__(self, steps: int, desc: str = "GRPO", disable: bool = False, initial: int = 0) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=steps, initial=initial, desc=desc, unit="step", disable=disable, dynamic_ncols=True)
        self.last_acc: float | None = None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        self.last_acc = metrics.get("eval/accuracy", self.last_acc)
        bitten = metrics.get("loss/is_trunc_frac", 0.0) + metrics.get("loss/is_masked_frac", 0.0)
        post = {
            "reward": f"{metrics.get('train/reward_mean', float('nan')):.2f}",
            "stale": f"{metrics.get('rollout/staleness_batch_mean', 0.0):.1f}",
            # trained against generated mean completion length: a gap is length bias
            "len": f"{metrics.get('length/trained_mean', 0.0):.1f}/{metrics.get('length/generated_mean', 0.0):.1f}",
            "is_cut": f"{bitten:.1%}",  # model tokens whose importance weight was capped or masked
            # completion tokens trained so far over those generated (the rest queued, in flight or dropped)
            "kept": f"{metrics.get('tokens/trained', 0) / max(1, metrics.get('tokens/generated', 0)):.0%}",
            "queue": int(metrics.get("queue/depth", 0)),
            "sync": f"{metrics.get('sync/total_s', 0.0) * 1000:.0f}ms",
        }
        if self.last_acc is not None:
            post["held_out"] = f"{self.last_acc:.0%}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


# ----------------------------------------------------------------------------------------------- plotting


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(rows: Sequence[dict[str, Any]], path: Path, before: float | None = None, title: str = "",
             start: int = 0) -> Path:
    """Reward and held-out accuracy, staleness, KL / entropy, and pause / sync times per learner step; ``before``
    is the accuracy at step ``start`` (0, or a resumed run's first step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    _series(axes[0, 0], rows, {"train/reward_mean": "train reward (mean)"}, smooth=10)
    acc = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if before is not None:
        acc = sorted([*acc, (start, before)])
    if acc:
        axes[0, 0].plot(*zip(*acc), "o-", color="C3", label="held-out greedy accuracy")
    axes[0, 0].set_ylim(0, 1.02)
    axes[0, 0].set_title("reward / accuracy")
    _series(axes[0, 1], rows, {"rollout/staleness_batch_mean": "staleness (batch mean)",
                               "rollout/staleness_batch_max": "staleness (batch max)",
                               "queue/depth": "queue depth"})
    axes[0, 1].set_title("staleness (versions) and queue depth (groups)")
    _series(axes[1, 0], rows, {"loss/approx_kl_behaviour": "KL(proximal || behaviour), k3",
                               "loss/kl": "KL to reference, k3", "loss/entropy": "entropy (nats)"})
    axes[1, 0].set_yscale("symlog", linthresh=1e-3)
    axes[1, 0].set_title("KL / entropy")
    _series(axes[1, 1], rows, {"sync/pause_s": "pause", "sync/transfer_s": "transfer",
                               "sync/resume_s": "resume", "sync/total_s": "sync total"}, scale=1000)
    axes[1, 1].set_title("weight sync (ms)")
    for ax in axes[1]:
        ax.set_xlabel("learner step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(ax: Any, rows: Sequence[dict[str, Any]], names: dict[str, str], smooth: int = 1,
            scale: float = 1.0) -> None:
    for key, label in names.items():
        pts = [(r["step"], float(r[key]) * scale) for r in rows if isinstance(r.get(key), (int, float))]
        if not pts:
            continue
        steps, values = zip(*pts)
        ax.plot(steps, values, label=label, alpha=0.35 if smooth > 1 else 0.9)
        if smooth > 1 and len(values) >= smooth:
            window = [sum(values[max(0, i - smooth + 1): i + 1]) / len(values[max(0, i - smooth + 1): i + 1])
                      for i in range(len(values))]
            ax.plot(steps, window, label=f"{label}, {smooth}-step mean")


def plot_tool_run(rows: Sequence[dict[str, Any]], path: Path, before: dict[str, float], after: dict[str, float],
                  steps: int, start: int = 0) -> Path:
    """A tool-use run (``tool_use.py``, ``openai_agent.py``): reward and accuracy, tool use, tool errors and
    truncation, staleness and sync, per step; ``before`` / ``after`` are the held-out ``accuracy`` and
    ``tool_rate`` at steps ``start`` and ``steps``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    evals = [(start, before)] + [(r["step"], {"accuracy": r["eval/accuracy"], "tool_rate": r["eval/tool_rate"]})
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


def print_tool_result(out: Path, result: dict[str, Any], png: Path, total_s: float) -> None:
    """The run's last lines: episodes trained, accuracy and tool-call rate before and after, where it wrote."""
    b, a = result["before"], result["after"]
    print(f"GRPO: {result['steps']} steps, {result['samples_trained']} episodes in {result['wall_s']:.0f}s; "
          f"dropped {result['dropped']}")
    print(f"held-out greedy accuracy: before {b['accuracy']:.1%} -> after {a['accuracy']:.1%}; "
          f"tool-call rate {b['tool_rate']:.1%} -> {a['tool_rate']:.1%}")
    print(f"run dir: {out}  (metrics.jsonl, {png.name}, summary.json); total {total_s:.0f}s")
