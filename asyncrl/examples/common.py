"""The examples' shared support: what every example's program does around its training (environment, logging,
the exit codes of ``run_cli``, SIGTERM as a cancellation, the JSON event stream), the tasks (the built-in addition
task, or a user prompts file read by ``asyncrl.data``) and their rewards, prompt streams, and the engine warm-up.

The other support modules build on this one, each with one role: ``sft.py`` builds and warm-starts the tiny model;
``tracking.py`` evaluates, checkpoints, reports and plots a run; ``demo.py`` is the run that ``grpo_offpolicy.py``
and ``online_dpo.py`` share; ``calculator.py`` is the tool-use task. Example programs import support modules only,
never one another, and no support module imports an example (pyproject.toml's import-linter contracts).

Everything here is example code: it may use vLLM and transformers directly. The library stays behind its
Engine Protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from asyncrl.data import (
    Example, PromptSource, answer_reward, encode_prompts, load_examples, load_reward, prompt_text, split_held_out,
)
from asyncrl.testing.tasks import arithmetic

RewardFn = Callable[[str, str], float]  # (completion text, reference answer) -> reward


def set_env_defaults(cache: Path | None = None) -> None:
    """Offline hub, quiet vLLM and a project-local vLLM cache (the KV cache size comes from
    ``VLLMEngineConfig.kv_cache_gib``)."""
    cache = cache or Path(".cache").resolve()  # beside the run directories, in the working directory
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


def run_cli(cli: Callable[[list[str] | None], int]) -> int:
    """Run an example's ``cli`` as its ``__main__`` block does: Ctrl-C exits 130 and SIGTERM (which ``asyncrl.run``
    turns into a cancellation, then ``Terminated``) 143, each with a line saying the run was cancelled, instead
    of a traceback."""
    from asyncrl.runtime import Terminated

    try:
        return cli(None)
    except KeyboardInterrupt:
        print("\ninterrupted: run cancelled, engine shut down", file=sys.stderr)
        return 130
    except Terminated as exc:
        print("\nterminated: run cancelled, engine shut down", file=sys.stderr)
        return int(exc.code)


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


class JsonEvents:
    """One JSON line per event, on a stream of their own. ``take_stdout`` makes that stream the process's
    original stdout and sends everything else written there to stderr, so a program piping stdout reads only
    events."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out

    def emit(self, event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}), file=self.out or sys.stdout, flush=True)

    def take_stdout(self) -> None:
        """Keep a private duplicate of file descriptor 1 for the events, then point descriptor 1 (and
        ``sys.stdout``) at stderr. At the descriptor level, so that it also holds for writers that bound the old
        ``sys.stdout`` already (vLLM's log handler writes to stdout by default) and for child processes, which
        inherit descriptor 1 (vLLM's engine-core processes)."""
        sys.stdout.flush()
        self.out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr


def jsonable(args: dict[str, Any]) -> dict[str, Any]:
    """Parsed arguments (``vars(args)``) as JSON can hold them: paths as strings. For ``summary.json`` and the
    monitor's run config."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}


# --------------------------------------------------------------------------------------------------- tasks


@dataclass(frozen=True, slots=True)
class Task:
    """Training problems, disjoint held-out problems and the reward that scores a completion."""

    name: str
    train: list[Example]
    held_out: list[Example]
    reward: RewardFn  # what accuracy counts as correct (held-out evaluation)
    train_reward: RewardFn | None = None  # what RL maximises, when it differs (e.g. partial credit)
    rl_reward: Callable[[Any, Any], Any] | None = None  # a library RewardFn (prompt, sample) RL maximises instead
    epochs: int | None = None  # passes over ``train`` in RL (None: without end, reshuffled every pass)


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


def load_prompts_file(path: str | Path, n_held_out: int = 200, seed: int = 0, prompt_key: str | None = None,
                      answer_key: str | None = None) -> Task:
    """A JSONL or Parquet file of problems (``asyncrl.data.load_examples``: plain, chat-message, verl and GSM8K
    layouts, or the columns named), split into training and held-out problems (``split_held_out``), scored by
    ``answer_reward``."""
    train, held_out = split_held_out(load_examples(path, prompt_key, answer_key), n_held_out, seed)
    return Task(Path(path).stem, train, held_out, answer_reward)


def reward_spec(value: str) -> str:
    """argparse type of ``--reward``: ``exact``, ``digits`` or ``package.module:function``."""
    if value in ("exact", "digits") or ":" in value:
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: expected exact, digits or package.module:function")


def task_from_args(args: argparse.Namespace) -> Task:
    """The task a ``grpo_offpolicy``-style command line asks for: the addition task or ``--prompts``, with the
    data group's ``--prompt-key``, ``--answer-key``, ``--epochs``, ``--chat-template`` and ``--reward``."""
    named = ":" in args.reward  # a library RewardFn: RL maximises it, accuracy stays exact match
    if args.prompts is None:
        task = arithmetic_task(n_held_out=args.held_out, seed=args.seed, reward="exact" if named else args.reward,
                               reversed_answers=args.reversed_answers)
    elif args.reward == "digits":
        raise SystemExit("--reward digits is for the addition task; a prompts file takes exact or module:function")
    else:
        task = load_prompts_file(args.prompts, args.held_out, args.seed, args.prompt_key, args.answer_key)
    if args.chat_template == "on" and not _has_chat_template(args.model):
        raise SystemExit(f"--chat-template on needs --model with a chat template; "
                         f"{args.model or 'the tiny model'} has none")
    if args.chat_template != "auto":
        task = replace(task, train=_as_chat(task.train, args.chat_template), held_out=_as_chat(task.held_out,
                                                                                               args.chat_template))
    return replace(task, rl_reward=load_reward(args.reward) if named else None, epochs=args.epochs or None)


def _has_chat_template(model: Any) -> bool:
    if model is None:
        return False
    from transformers import AutoTokenizer

    return bool(AutoTokenizer.from_pretrained(str(model)).chat_template)


def _as_chat(examples: list[Example], mode: str) -> list[Example]:
    """``on``: every prompt as chat messages (a string becomes one user message), so the tokenizer's template
    applies; ``off``: every prompt as plain text (messages' contents joined), so none does."""
    if mode == "on":
        return [ex if isinstance(ex.prompt, list) else Example([{"role": "user", "content": ex.prompt}], ex.answer)
                for ex in examples]
    return [ex if isinstance(ex.prompt, str) else Example(prompt_text(ex.prompt, None, False), ex.answer)
            for ex in examples]


def rl_prompts(task: Task, tokenizer: Any, seed: int) -> PromptSource:
    """The training problems as a ``PromptSource``: ``task.epochs`` passes (None: without end), each in its own
    seeded order."""
    return PromptSource(encode_prompts(task.train, tokenizer, id_prefix="train-"), epochs=task.epochs,
                        shuffle_seed=seed)


def endless(items: Sequence[Any], seed: int) -> Iterator[tuple[int, Any]]:
    """``(index, item)`` pairs without end: every pass over ``items`` in a new order drawn from ``seed``."""
    rng = random.Random(seed)
    for _ in itertools.count():
        order = list(range(len(items)))
        rng.shuffle(order)
        yield from ((i, items[i]) for i in order)


def pad_id(tok: Any) -> int:
    """The id the learner pads rows with: the tokenizer's pad token, else its end-of-sequence token."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def prompt_reward(task: Task) -> Callable[[Any, Any], Any]:
    """The producer's reward function: ``task.rl_reward``, else the task's training reward on the sample's text
    vs the prompt's answer."""
    if task.rl_reward is not None:
        return task.rl_reward
    reward = task.train_reward or task.reward
    return lambda prompt, sample: reward(sample.text, prompt.answer)


def queue_capacity(batch_groups: int, max_staleness: int) -> int:
    """Rollout-queue size for asynchronous runs: ``batch_groups x max(1, max_staleness - 1)``.

    When generation outpaces the learner (the usual case for a tiny model), a finished group waits about one
    version blocked on the full queue and then ``capacity / batch_groups`` versions in it, so this keeps
    most groups within ``max_staleness`` instead of generating work that is dropped as stale.
    """
    return batch_groups * max(1, max_staleness - 1)


# ----------------------------------------------------------------------------------------- engine warm-up


async def warm_up(engine: Any, prompt_ids: Sequence[int], sampling: Any, groups: int) -> None:
    """Sample ``groups`` groups at once, as a training batch does: vLLM's first requests with log-probs, and
    its first large batches, pay one-off costs of seconds that would otherwise land in the first steps."""
    async with asyncio.TaskGroup() as tg:
        for i in range(groups):
            tg.create_task(engine.generate(tuple(prompt_ids), sampling, request_id=f"asyncrl-warm-up-{i}"))
