"""Pieces shared by ``examples/grpo_offpolicy.py`` and ``bench/learning.py``.

- Tasks: the built-in addition task, or a user prompts file (JSONL / Parquet with ``prompt`` / ``answer``).
- A tiny character-level Qwen2 model and its supervised warm start (teacher forcing on prompt -> answer + EOS),
  stopped once held-out greedy accuracy reaches a target, so RL starts from a policy that is right sometimes.
- Held-out accuracy with greedy decoding, in transformers (during the warm start) or through a running
  ``VLLMEngine`` (temperature 0 on its ``AsyncLLM``: ``SamplingConfig`` requires temperature > 0).
- Learner hooks: a tqdm progress bar, and a periodic held-out evaluation that adds ``eval/accuracy``.
- The run plot.

Everything here is example code: it may use vLLM and transformers directly. The library stays behind its
Engine Protocol.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.tasks import arithmetic

log = logging.getLogger("examples")

ROOT = Path(__file__).resolve().parents[1]
RewardFn = Callable[[str, str], float]  # (completion text, reference answer) -> reward


def set_env_defaults(cache: Path | None = None) -> None:
    """Offline hub, quiet vLLM and a project-local vLLM cache (the KV cache size comes from
    ``VLLMEngineConfig.kv_cache_gib``)."""
    cache = cache or ROOT / ".cache"
    for key, value in {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_CACHE_ROOT": str(cache / "vllm"), "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
    }.items():
        os.environ.setdefault(key, value)


def start_cli(verbose: bool, torch_threads: int) -> None:
    """What every example's command line does first: environment, logging, quiet progress bars, threads."""
    if not verbose:  # vLLM's per-sync layerwise-reload warnings would bury the progress bar
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    set_env_defaults()
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(max(1, torch_threads))


def cancel_on_sigterm() -> None:
    """Make SIGTERM (a supervisor stopping the job) cancel the running task, as Ctrl-C does: the run is cancelled
    and the engine shut down, instead of the process dying and leaving its engine's files behind."""
    import asyncio
    import signal

    task = asyncio.current_task()
    assert task is not None, "call from inside the example's main coroutine"
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


def announce_engine_start() -> None:
    """Say on screen why the first engine start on a machine is slow, so nobody takes it for a hang: torch
    compiles the engine's kernels once and caches them (``TORCHINDUCTOR_CACHE_DIR``, by default
    ``/tmp/torchinductor_<user>``); later starts load them."""
    import getpass
    import tempfile

    cache = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                 or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    first = not cache.is_dir() or not any(cache.iterdir())
    print("starting the vLLM engine" + (f" (first start on this machine: kernels are compiled once and cached "
                                        f"under {cache}, so this start takes longer)" if first else ""),
          flush=True)


# --------------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True, slots=True)
class Example:
    """One problem: the prompt (text, or chat messages) and its reference answer."""

    prompt: str | list[dict[str, str]]
    answer: str


@dataclass(frozen=True, slots=True)
class Task:
    """Training problems, disjoint held-out problems and the reward that scores a completion."""

    name: str
    train: list[Example]
    held_out: list[Example]
    reward: RewardFn  # what accuracy counts as correct (held-out evaluation)
    train_reward: RewardFn | None = None  # what RL maximises, when it differs (e.g. partial credit)


def arithmetic_task(n_train: int = 9000, n_held_out: int = 200, seed: int = 0, reward: str = "exact",
                    reversed_answers: bool = False) -> Task:
    """``a+b=`` with operands 0..99. Accuracy is exact match (``arithmetic.reward``); RL maximises the same, or
    with ``reward="digits"`` partial credit per right digit (``arithmetic.digit_reward``). With
    ``reversed_answers`` the sum is written ones digit first, the order in which a carry flows."""
    train, held_out = arithmetic.split(n_train, n_held_out, seed=seed)
    order = (lambda a: a[::-1]) if reversed_answers else (lambda a: a)  # noqa: E731
    to_ex = lambda ps: [Example(p.prompt, order(p.answer)) for p in ps]  # noqa: E731
    train_reward = {"exact": arithmetic.reward, "digits": arithmetic.digit_reward}[reward]
    return Task("arithmetic", to_ex(train), to_ex(held_out), arithmetic.reward, train_reward)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def reference_answer(answer: str) -> str:
    """The part of ``answer`` a completion must match: the text after the last ``####`` (GSM8K's solution
    format) when there is one, else the whole answer, stripped."""
    return answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer.strip()


def answer_reward(completion: str, answer: str) -> float:
    """Reward for user prompts files: 1.0 when the stripped completion equals the reference answer.

    When the reference is a number (GSM8K: ``"72"`` or ``"... #### 72"``), the last number in the completion
    is compared with it instead (commas ignored), as GSM8K's "flexible" scoring does. Otherwise 0.0.
    """
    ref = reference_answer(answer)
    text = completion.strip()
    if text == ref:
        return 1.0
    ref_num = _as_number(ref)
    if ref_num is None:
        return 0.0
    found = _NUMBER.findall(text)
    return 1.0 if found and _as_number(found[-1]) == ref_num else 0.0


def _as_number(text: str) -> float | None:
    text = text.replace(",", "").strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def load_prompts_file(path: str | Path, n_held_out: int = 200, seed: int = 0) -> Task:
    """Read a JSONL or Parquet file of problems and split off a held-out set (seeded shuffle).

    Each row needs a ``prompt`` (a string, or chat messages ``[{"role", "content"}]`` as in verl's GSM8K
    parquet) and an answer: ``answer``, else ``reward_model.ground_truth`` (verl), else
    ``extra_info.answer``. The held-out set is ``min(n_held_out, len // 5)`` rows (at least 1); with a
    single row it is also the training set.
    """
    rows = _read_rows(Path(path))
    examples = [_example_of(row, i, path) for i, row in enumerate(rows)]
    if not examples:
        raise ValueError(f"{path}: no rows")
    random.Random(seed).shuffle(examples)
    k = max(1, min(n_held_out, len(examples) // 5))
    train = examples[k:] or examples
    return Task(Path(path).stem, train, examples[:k], answer_reward)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _example_of(row: dict[str, Any], index: int, path: str | Path) -> Example:
    prompt = row.get("prompt")
    answer = row.get("answer")
    if answer is None and isinstance(row.get("reward_model"), dict):
        answer = row["reward_model"].get("ground_truth")
    if answer is None and isinstance(row.get("extra_info"), dict):
        answer = row["extra_info"].get("answer")
    if not prompt or answer is None:
        raise ValueError(f"{path}: row {index} needs a 'prompt' and an 'answer' (or reward_model.ground_truth)")
    if not isinstance(prompt, str):
        prompt = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    return Example(prompt, str(answer))


def prompt_text(prompt: str | list[dict[str, str]], tokenizer: Any) -> str:
    """Chat messages go through the tokenizer's chat template (generation prompt added) when it has one,
    else their contents are joined with newlines."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in prompt)


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, str]]) -> tuple[int, ...]:
    """Token ids of a prompt. A chat template already holds any BOS text, so none is added to its output."""
    return tuple(tokenizer(prompt_text(prompt, tokenizer), add_special_tokens=isinstance(prompt, str)).input_ids)


def rl_prompts(task: Task, tokenizer: Any, seed: int) -> Iterator[Any]:
    """An endless stream of ``asyncrl.Prompt`` over the training problems, reshuffled every epoch."""
    from asyncrl import Prompt

    encoded = [(encode_prompt(tokenizer, ex.prompt), ex) for ex in task.train]
    rng = random.Random(seed)
    for epoch in itertools.count():
        order = list(range(len(encoded)))
        rng.shuffle(order)
        for i in order:
            ids, ex = encoded[i]
            yield Prompt(f"train-{i}", ids, prompt_text(ex.prompt, tokenizer), ex.answer)


def prompt_reward(task: Task) -> Callable[[Any, Any], float]:
    """The producer's reward function: the task's training reward on the sample's text vs the prompt's answer."""
    reward = task.train_reward or task.reward
    return lambda prompt, sample: reward(sample.text, prompt.answer)


def queue_capacity(batch_groups: int, max_staleness: int) -> int:
    """Rollout-queue size for asynchronous runs: ``batch_groups x max(1, max_staleness - 1)``.

    When generation outpaces the learner (the usual case for a tiny model), a finished group waits about one
    version blocked on the full queue and then ``capacity / batch_groups`` versions in it, so this keeps
    most groups within ``max_staleness`` instead of generating work that is dropped as stale.
    """
    return batch_groups * max(1, max_staleness - 1)


# ------------------------------------------------------------------------------------- tiny model + SFT


def tiny_spec(hidden: int = 128, layers: int = 2, vocab: int = 32, context: int = 256, seed: int = 0) -> Any:
    """A Qwen2 shape with head size 32 (vLLM CPU supports it), GQA 2:1, tied embeddings."""
    from asyncrl.tiny import TinyModelSpec

    if hidden % 64:
        raise ValueError(f"hidden size must be a multiple of 64 (head size 32, 2 query heads per KV head), "
                         f"got {hidden}")
    return TinyModelSpec(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=hidden // 64,
                         vocab_size=vocab, max_position_embeddings=context, seed=seed)


def build_char_model(out_dir: Path, task: Task, hidden: int, layers: int, seed: int,
                     added_tokens: Sequence[str] = ()) -> Path:
    """A character-level tokenizer over the task's text and a random tiny Qwen2 model, in ``out_dir``.

    Characters, not BPE merges: digits as single tokens make addition learnable by a tiny model in seconds.
    ``added_tokens`` are extra single tokens (tool-call markers, say) that decode as their text.
    """
    from asyncrl.tiny import SPECIAL_TOKENS, build_model, build_tokenizer

    texts = arithmetic.corpus() + [_plain(ex.prompt) + ex.answer for ex in task.train + task.held_out]
    alphabet = set("".join(texts))
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(texts, out_dir, vocab_size=len(alphabet) + len(SPECIAL_TOKENS), added_tokens=added_tokens)
    longest = max(len(_plain(ex.prompt)) + len(ex.answer) for ex in task.train + task.held_out)
    context = max(256, 2 ** math.ceil(math.log2(longest + 64)))
    build_model(out_dir, tiny_spec(hidden, layers, vocab=32 * math.ceil(vocab / 32), context=context, seed=seed),
                vocab)
    return out_dir


def _plain(prompt: str | list[dict[str, str]]) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


@dataclass(frozen=True, slots=True)
class WarmStart:
    """Supervised warm start: teacher forcing on prompt -> answer + EOS until held-out greedy accuracy
    reaches ``target`` (checked every ``eval_every`` steps) or ``max_steps`` steps were taken."""

    target: float = 0.3  # stop once held-out greedy accuracy is at least this (fraction)
    max_steps: int = 3000
    lr: float = 3e-3
    batch: int = 64  # problems per step
    eval_every: int = 25
    eval_size: int = 200  # held-out problems used for the stopping check
    seed: int = 0
    autocast: str | None = None  # "bfloat16": the SFT forward/backward under bf16 autocast (other numerics)
    # Stop on the mean of this many evaluations: accuracy jumps by several points between evaluations, and a
    # model stopped on one lucky spike is a worse start for RL than one that holds the target.
    window: int = 1


@dataclass(slots=True)
class WarmStartResult:
    steps: int = 0
    accuracy: float = 0.0  # held-out greedy accuracy at the end (transformers)
    seconds: float = 0.0
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, accuracy)


def warm_start(model_dir: Path, task: Task, cfg: WarmStart, progress: bool = True) -> WarmStartResult:
    """Train the model in ``model_dir`` in place (saved back there) and return what happened."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    data = [(list(encode_prompt(tok, ex.prompt)), tok(ex.answer, add_special_tokens=False).input_ids
             + [tok.eos_token_id]) for ex in task.train]
    held_out = task.held_out[: cfg.eval_size]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    result = WarmStartResult()
    t0 = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, desc="warm start", unit="step", disable=not progress, leave=False)
    for step in range(1, cfg.max_steps + 1):
        with _precision(cfg.autocast):
            loss = _sft_step(model, optimizer, [rng.choice(data) for _ in range(cfg.batch)], tok.pad_token_id)
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            acc = hf_greedy_accuracy(model, tok, held_out, task.reward)
            result.history.append((step, acc))
            bar.set_postfix(loss=f"{loss:.3f}", held_out=f"{acc:.0%}")
            recent = [a for _, a in result.history[-cfg.window:]]
            if len(recent) == cfg.window and sum(recent) / cfg.window >= cfg.target:
                break
    bar.close()
    result.steps, result.accuracy, result.seconds = step, result.history[-1][1], time.perf_counter() - t0
    model.save_pretrained(str(model_dir))
    return result


def _precision(autocast: str | None) -> Any:
    import contextlib

    import torch

    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu", dtype=getattr(torch, autocast))


def _sft_step(model: Any, optimizer: Any, items: Sequence[tuple[list[int], list[int]]], pad_id: int) -> float:
    import torch

    width = max(len(p) + len(a) for p, a in items)
    ids = torch.full((len(items), width), pad_id)
    labels = torch.full((len(items), width), -100)
    attention = torch.zeros((len(items), width), dtype=torch.long)
    for i, (p, a) in enumerate(items):
        row = p + a
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        labels[i, len(p): len(row)] = torch.tensor(a)  # loss on the answer and EOS only
    model.train()
    loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def hf_greedy_accuracy(model: Any, tok: Any, problems: Sequence[Example], reward: RewardFn,
                       max_new_tokens: int = 6) -> float:
    """Greedy decoding in transformers, prompts batched by length (no padding needed)."""
    import torch

    by_len: dict[int, list[tuple[list[int], Example]]] = {}
    for ex in problems:
        ids = list(encode_prompt(tok, ex.prompt))
        by_len.setdefault(len(ids), []).append((ids, ex))
    correct = 0.0
    model.eval()
    with torch.no_grad():
        for length, items in by_len.items():
            ids = torch.tensor([i for i, _ in items])
            for _ in range(max_new_tokens):
                nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
                ids = torch.cat([ids, nxt[:, None]], dim=1)
            for row, (_, ex) in zip(ids[:, length:].tolist(), items):
                if tok.eos_token_id in row:
                    correct += reward(tok.decode(row[: row.index(tok.eos_token_id)]), ex.answer)
    return correct / max(1, len(problems))


# ------------------------------------------------------------------------------------- engine evaluation


async def engine_greedy_accuracy(engine: Any, tok: Any, problems: Sequence[Example], reward: RewardFn,
                                 max_tokens: int, batch: str = "eval") -> float:
    """Held-out accuracy with greedy decoding (temperature 0) on ``engine``'s current weights.

    Runs beside training requests; nothing is paused. Goes through ``engine.llm`` (a ``VLLMEngine``'s
    ``AsyncLLM``) because ``SamplingConfig`` refuses temperature 0.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(i: int, ex: Example) -> float:
        final = None
        ids = list(encode_prompt(tok, ex.prompt))
        async for out in engine.llm.generate({"prompt_token_ids": ids}, params, request_id=f"eval-{batch}-{i}"):
            final = out
        return reward(final.outputs[0].text, ex.answer) if final is not None else 0.0

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(one(i, ex)) for i, ex in enumerate(problems)]
    return sum(t.result() for t in tasks) / max(1, len(problems))


async def warm_up(engine: Any, prompt_ids: Sequence[int], sampling: Any, groups: int) -> None:
    """Sample ``groups`` groups at once, as a training batch does: vLLM's first requests with log-probs, and
    its first large batches, pay one-off costs of seconds that would otherwise land in the first steps."""
    async with asyncio.TaskGroup() as tg:
        for i in range(groups):
            tg.create_task(engine.generate(tuple(prompt_ids), sampling, request_id=f"asyncrl-warm-up-{i}"))


# ------------------------------------------------------------------------------------------ learner hooks


class EvalHook:
    """Every ``every`` steps, measure held-out greedy accuracy on the engine and add it as ``eval/accuracy``.

    The learner waits for the evaluation (producers keep generating). ``seconds`` totals the time spent
    here; ``points`` holds ``(step, accuracy, clock_s)`` where ``clock_s`` is the time since the hook was
    created minus the evaluation time before it, i.e. the training wall time at which the weights were
    measured.
    """

    def __init__(self, engine: Any, tok: Any, task: Task, max_tokens: int, every: int) -> None:
        self.engine, self.tok, self.task, self.max_tokens, self.every = engine, tok, task, max_tokens, every
        self.seconds = 0.0
        self.points: list[tuple[int, float, float]] = []
        self.t0 = time.perf_counter()
        self._evals = itertools.count()  # request ids must differ between evaluations

    async def evaluate(self, step: int) -> float:
        t0 = time.perf_counter()
        acc = await engine_greedy_accuracy(self.engine, self.tok, self.task.held_out, self.task.reward,
                                           self.max_tokens, batch=f"eval{next(self._evals)}")
        self.points.append((step, acc, t0 - self.t0 - self.seconds))
        self.seconds += time.perf_counter() - t0
        return acc

    async def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if self.every > 0 and step % self.every == 0:
            metrics["eval/accuracy"] = await self.evaluate(step)


def lr_schedule(optimizer: Any, warmup: int = 0, decay_to: int = 0) -> Callable[[int, dict[str, float]], None]:
    """A learner hook shaping the learning rate: a linear ramp over the first ``warmup`` steps (Adam's first
    updates move every weight by about lr whatever the gradient, which can wreck a tiny policy at once), then,
    with ``decay_to`` > 0, a linear decay reaching 0 at step ``decay_to`` (a tiny policy's greedy answers flip
    from one step to the next; a vanishing step lets the last ones settle)."""
    from torch.optim.lr_scheduler import LambdaLR

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return ramp * (max(0.0, 1.0 - step / decay_to) if decay_to else 1.0)

    schedule = LambdaLR(optimizer, factor)
    return lambda step, metrics: schedule.step()


class ProgressHook:
    """A tqdm bar over learner steps: reward, staleness, queue depth, last sync time, last accuracy."""

    def __init__(self, steps: int, desc: str = "GRPO", disable: bool = False) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=steps, desc=desc, unit="step", disable=disable, dynamic_ncols=True)
        self.last_acc: float | None = None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        self.last_acc = metrics.get("eval/accuracy", self.last_acc)
        post = {
            "reward": f"{metrics.get('train/reward_mean', float('nan')):.2f}",
            "stale": f"{metrics.get('rollout/staleness_batch_mean', 0.0):.1f}",
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


def plot_run(rows: Sequence[dict[str, Any]], path: Path, before: float | None = None, title: str = "") -> Path:
    """Reward and held-out accuracy, staleness, KL / entropy, and pause / sync times per learner step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex=True)
    _series(axes[0, 0], rows, {"train/reward_mean": "train reward (mean)"}, smooth=10)
    acc = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if before is not None:
        acc.insert(0, (0, before))
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
