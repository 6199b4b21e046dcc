"""The synthetic task of ``bench.gpu.workload``: count down, with long-tailed answer lengths the model learns.

A prompt is 100-300 tokens: filler words, then ``count down from`` and the number L as a word; the answer is the
words of L-1 ... 1 0, then end-of-sequence (L + 1 tokens). Numbers are written in letters (``w`` and three
base-26 digits: ``wazz``). L is drawn lognormal (mean ~256, sigma 0.8, clipped to 4..1000), so a policy that has
learned the task produces the long-tailed lengths of real reasoning traces on its own: most groups finish in a
few hundred tokens, a few run to a thousand. Every number and filler word is one token of a byte-level BPE
trained on the task's words (letters only, so the Qwen2 tokenizer that transformers and vLLM load for a Qwen2
model splits them the same way), so the task is a successor table (K -> K-1, 0 -> end) that a randomly
initialised Qwen2 learns in a brief supervised warm start (``warm_start``). The reward is verifiable from the
text: the share of the expected countdown the completion gets right from its start (1.0 only when exact).

    python -m bench.gpu.countdown build OUT --shape qwen2-0.5b        # tokenizer + random model (own process)
    python -m bench.gpu.countdown warm SRC OUT --steps 150            # supervised warm start on the GPU

Module level is the standard library only: TRL's side imports ``reward`` and ``problems`` from here.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_L = 1000  # the default longest answer (``--max-answer`` raises it up to WORDS)
WORDS = 4096  # numbers the tokenizer holds as single tokens: the longest answer any run can ask for
MIN_L = 4
MEAN_L = 256
SIGMA = 0.8
FILLER = 256  # filler words
INSTRUCTION = ("count", "down", "from")
FIRST = "begin"  # every prompt starts with it (the only word without a space before it)
SHAPES = {  # Qwen2 shapes; the vocabulary stays Qwen2's (the lm_head is a large share of a small model's work)
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=5120),
    # Planted policies (``bench.gpu.planted``): untied heads, built from tensors rather than warm-started.
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, tie_word_embeddings=False),
    "llama3.1-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=5e5,
                        tie_word_embeddings=False),
    "tiny-untied": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=5120, tie_word_embeddings=False),
}


def is_planted(shape: str) -> bool:
    """Whether ``shape`` is built by ``bench.gpu.planted`` (an untied head holds the task) rather than built and
    warm-started here (the shapes without ``tie_word_embeddings``, which ``build`` ties)."""
    return SHAPES[shape].get("tie_word_embeddings") is False


def number(k: int) -> str:
    """K as a word of letters: ``w`` and three base-26 digits (0 -> ``waaa``, 27 -> ``wabb``)."""
    return "w" + "".join(chr(97 + k // 26 ** i % 26) for i in (2, 1, 0))


def filler(i: int) -> str:
    return "f" + chr(97 + i // 26) + chr(97 + i % 26)


def value(word: str) -> int:
    """The number a ``number`` word stands for; -1 for any other word."""
    if len(word) != 4 or word[0] != "w" or not word[1:].isalpha() or not word[1:].islower():
        return -1
    return sum((ord(c) - 97) * 26 ** i for i, c in zip((2, 1, 0), word[1:]))


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str  # "begin", filler words, then "count down from" and the number L
    length: int  # L: the answer has L words (then end-of-sequence)

    @property
    def answer(self) -> str:
        """The expected completion, as the engine would decode it (each word after a space)."""
        return "".join(f" {number(k)}" for k in range(self.length - 1, -1, -1))


def problems(seed: int, count: int, *, max_len: int = MAX_L, prompt_range: tuple[int, int] = (100, 300),
             mean_len: float | None = None) -> list[Problem]:
    """``count`` seeded problems, answer lengths lognormal of mean ``mean_len`` clipped to ``max_len``. Without
    ``mean_len`` the mean scales with ``max_len`` (``MEAN_L`` at ``MAX_L``: CPU smoke runs shrink both)."""
    if not MIN_L <= max_len <= WORDS:
        raise ValueError(f"max_len must lie in [{MIN_L}, {WORDS}] (the numbers the tokenizer holds), got {max_len}")
    rng = random.Random(seed)
    mu = math.log(mean_len or MEAN_L * max_len / MAX_L) - SIGMA ** 2 / 2
    out = []
    for _ in range(count):
        length = min(max_len, max(MIN_L, round(rng.lognormvariate(mu, SIGMA))))
        count = rng.randint(*prompt_range) - len(INSTRUCTION) - 2
        words = [filler(rng.randrange(FILLER)) for _ in range(count)]
        out.append(Problem(" ".join([FIRST, *words, *INSTRUCTION, number(length)]), length))
    return out


def reward(completion: str, length: int) -> float:
    """Share of the expected answer matched from the completion's start, its end counting as one more item:
    1.0 only when exact (nothing after the 0), else right words / (L + 1)."""
    words = completion.split()
    right = 0
    for k, word in zip(range(length - 1, -1, -1), words):
        if value(word) != k:
            break
        right += 1
    return 1.0 if right == length and len(words) == length else right / (length + 1)


def length_of(prompt_text: str) -> int:
    return value(prompt_text.split()[-1])


# ------------------------------------------------------------------------------------------- model building


def build_tokenizer(out: Path) -> int:
    """A byte-level BPE in which every task word (after a space, and ``begin`` without) is one token, with a
    chat template that renders message contents as they are (TRL's async trainer needs one)."""
    from asyncrl.testing.tiny import build_tokenizer as train_bpe

    words = [*INSTRUCTION, *(number(k) for k in range(WORDS + 1)), *(filler(i) for i in range(FILLER))]
    corpus = [f"{FIRST} " + " ".join(words)] * 4  # each word seen after a space: one merge chain per word
    size = train_bpe(corpus, out, vocab_size=8192)
    config = out / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config.write_text(json.dumps(data, indent=2))
    return size


def check_tokenizer(model_dir: Path) -> None:
    """Every task word one token, as transformers (hence vLLM and TRL) loads the tokenizer of ``model_dir``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sample = problems(0, 1, max_len=60)[0]
    text = sample.prompt + sample.answer + "".join(f" {number(k)}" for k in range(0, WORDS + 1, 97))
    ids = tok(text, add_special_tokens=False).input_ids
    if len(ids) != len(text.split()) or tok.decode(ids) != text:
        raise RuntimeError(f"{model_dir}: task words are not single tokens ({len(ids)} ids for "
                           f"{len(text.split())} words)")


def build(out: Path, shape: str, seed: int = 0) -> Path:
    """Tokenizer + randomly initialised bf16 Qwen2 of ``shape`` in ``out``."""
    from asyncrl.testing.tiny import TinyModelSpec, build_model

    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    spec = TinyModelSpec(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                         dtype="bfloat16" if shape != "tiny" else "float32", seed=seed)
    build_model(out, spec, vocab)
    check_tokenizer(out)
    return out


# ----------------------------------------------------------------------------------------------- warm start


def sft_batch(tok: Any, batch: list[Problem], device: Any) -> tuple[Any, Any, Any]:
    """(input_ids, attention_mask, target_mask) of prompt + answer + EOS rows, right-padded: the loss covers the
    answer and its EOS."""
    import torch

    rows, masks = [], []
    for p in batch:
        prompt = tok(p.prompt, add_special_tokens=False).input_ids
        answer = tok(p.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]  # " w..." chunks alone
        rows.append(prompt + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    target = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        target[i, : len(r)] = torch.tensor(m, dtype=torch.bool)
    return ids.to(device), attn.to(device), target.to(device)


def answer_logits(model: Any, ids: Any, attn: Any, target: Any) -> tuple[Any, Any]:
    """Logits at the positions that predict answer tokens, and those tokens. The lm_head runs on these rows
    alone: the vocabulary is 152k wide, logits for every position would dominate the memory."""
    hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state
    at = target[:, 1:]  # position t predicts token t + 1
    return model.lm_head(hidden[:, :-1][at]), ids[:, 1:][at]


def accuracy(model: Any, tok: Any, batch: list[Problem], device: str) -> float:
    """Teacher-forced greedy accuracy over the answer tokens and their end-of-sequence."""
    import torch

    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        logits, targets = answer_logits(model, *sft_batch(tok, batch, device))
    return float((logits.argmax(-1) == targets).float().mean())


def warm_start(src: Path, out: Path, *, steps: int, batch: int, lr: float, seed: int, max_len: int,
               prompt_range: tuple[int, int] = (100, 300), target: float = 0.998, check_every: int = 25) -> dict:
    """Supervised warm start of ``src``'s random model into ``out`` (same tokenizer), on the GPU if there is
    one: at most ``steps`` steps, stopping early once the teacher-forced accuracy on held-out problems reaches
    ``target`` (checked every ``check_every`` steps). Returns the loss, the accuracy and the time taken."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=device == "cuda")
    data = problems(seed + 10_000, steps * batch, max_len=max_len, prompt_range=prompt_range)  # unseen later
    held_out = problems(seed + 20_000, batch, max_len=max_len, prompt_range=prompt_range)
    losses, acc, t0 = [], 0.0, time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:  # linear warm-up over the first 10% of the steps
            group["lr"] = lr * min(1.0, (step + 1) / max(1, steps // 10))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits, targets = answer_logits(model, *sft_batch(tok, data[step * batch:(step + 1) * batch], device))
            loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % check_every == 0 and (acc := accuracy(model, tok, held_out, device)) >= target:
            break
    seconds = time.perf_counter() - t0
    acc = accuracy(model, tok, held_out, device)
    saved = json.loads((src / "config.json").read_text())
    model.to(getattr(torch, saved.get("dtype") or saved.get("torch_dtype") or "float32")).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return {"steps": len(losses), "max_steps": steps, "batch": batch, "lr": lr, "seconds": seconds,
            "loss_first": losses[0], "loss_last": sum(losses[-5:]) / len(losses[-5:]),
            "held_out_token_accuracy": acc, "device": device}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("out", type=Path)
    b.add_argument("--shape", choices=list(SHAPES), default="qwen2-0.5b")
    b.add_argument("--seed", type=int, default=0)
    w = sub.add_parser("warm")
    w.add_argument("src", type=Path)
    w.add_argument("out", type=Path)
    w.add_argument("--steps", type=int, default=150)
    w.add_argument("--batch", type=int, default=16)
    w.add_argument("--lr", type=float, default=3e-4)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-len", type=int, default=MAX_L)
    w.add_argument("--prompt-range", type=int, nargs=2, default=(100, 300))
    args = p.parse_args(argv)
    if args.cmd == "build":
        build(args.out, args.shape, args.seed)
        print(json.dumps({"built": str(args.out)}), flush=True)
    else:
        info = warm_start(args.src, args.out, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                          max_len=args.max_len, prompt_range=tuple(args.prompt_range))
        print("WARM " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
