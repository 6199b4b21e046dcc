"""Pieces shared by the examples (``grpo_offpolicy.py``, ``tool_use.py``, ``distributed_grpo.py``) and the
benchmarks built on them: command-line set-up, the tasks (the built-in addition task, or a user prompts file,
JSONL / Parquet with ``prompt`` / ``answer``), prompt encoding and rewards, and the engine warm-up.
``sft.py`` builds and warm-starts the tiny model; ``tracking.py`` evaluates, reports and plots.

Everything here is example code: it may use vLLM and transformers directly. The library stays behind its
Engine Protocol.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


# ----------------------------------------------------------------------------------------- engine warm-up


async def warm_up(engine: Any, prompt_ids: Sequence[int], sampling: Any, groups: int) -> None:
    """Sample ``groups`` groups at once, as a training batch does: vLLM's first requests with log-probs, and
    its first large batches, pay one-off costs of seconds that would otherwise land in the first steps."""
    async with asyncio.TaskGroup() as tg:
        for i in range(groups):
            tg.create_task(engine.generate(tuple(prompt_ids), sampling, request_id=f"asyncrl-warm-up-{i}"))
