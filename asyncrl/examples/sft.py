"""The examples' tiny character-level Qwen2 model and its supervised warm starts, so RL starts from a policy that
is right sometimes: teacher forcing on prompt -> answer + EOS, stopped once held-out greedy accuracy (transformers,
batched by prompt length) reaches a target (``warm_start``); and, for the tool-use examples, teacher forcing on
demonstrations in the calculator's call format (``tool_warm_start``). A support module (see ``common.py``)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.testing.tasks import arithmetic
from asyncrl.data import encode_prompt
from asyncrl.examples.calculator import CALL, END_CALL, END_RES, RES
from asyncrl.examples.common import Example, RewardFn, Task


def tiny_spec(hidden: int = 128, layers: int = 2, vocab: int = 32, context: int = 256, seed: int = 0) -> Any:
    """A Qwen2 shape with head size 32 (vLLM CPU supports it), GQA 2:1, tied embeddings."""
    from asyncrl.testing.tiny import TinyModelSpec

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
    from asyncrl.testing.tiny import SPECIAL_TOKENS, build_model, build_tokenizer

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
    data = [(list(encode_prompt(ex.prompt, tok)), tok(ex.answer, add_special_tokens=False).input_ids
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
        ids = list(encode_prompt(ex.prompt, tok))
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


# ----------------------------------------------------------------------------------- tool-use warm start


def tool_demonstration(tok: Any, ex: Example, use_tool: bool) -> tuple[list[int], list[int]]:
    """Token ids of one solved ``a*b=`` episode in the calculator's call format, with or without a call, and its
    labels (-100 on the prompt and on environment tokens)."""
    a, b = ex.prompt.rstrip("=").split("*")
    segments = [(f"{CALL}{a}*{b}{END_CALL}", True), (f"{RES}{ex.answer}{END_RES}", False)] if use_tool else []
    ids = list(encode_prompt(ex.prompt, tok))
    labels = [-100] * len(ids)
    for text, trained in [*segments, (ex.answer, True)]:
        seg = tok(text, add_special_tokens=False).input_ids
        ids += seg
        labels += seg if trained else [-100] * len(seg)
    return ids + [tok.eos_token_id], labels + [tok.eos_token_id]


def tool_warm_start(model_dir: Path, task: Task, steps: int, tool_frac: float, lr: float, seed: int,
                    progress: bool = True, batch: int = 64) -> dict[str, Any]:
    """Teacher forcing for ``steps`` steps on a mix of tool-using (a share ``tool_frac``) and direct
    demonstrations (``tool_demonstration``), so RL starts from a policy that calls the tool sometimes; the model
    is saved in place."""
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
        rows = [tool_demonstration(tok, rng.choice(task.train), rng.random() < tool_frac) for _ in range(batch)]
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
