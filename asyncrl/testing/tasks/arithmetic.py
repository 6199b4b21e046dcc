"""Small-integer addition: a task a tiny model can learn on a 2-core CPU in minutes.

A problem is ``"a+b="`` with the answer ``str(a + b)``; the reward is 1.0 for the exact answer followed by
end-of-sequence (or the length limit), else 0.0.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str  # e.g. "12+7="
    answer: str  # e.g. "19"


def problems(seed: int, max_operand: int = 99) -> Iterator[Problem]:
    """An endless, seeded stream of addition problems."""
    rng = random.Random(seed)
    while True:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        yield Problem(f"{a}+{b}=", str(a + b))


def split(n_train: int, n_test: int, seed: int = 0, max_operand: int = 99) -> tuple[list[Problem], list[Problem]]:
    """Disjoint train and held-out problem lists."""
    seen: set[str] = set()
    out: list[Problem] = []
    for p in problems(seed, max_operand):
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
        if len(out) == n_train + n_test or len(seen) >= (max_operand + 1) ** 2:
            break
    return out[:n_train], out[n_train:]


def corpus(max_operand: int = 99) -> list[str]:
    """Text the tokenizer is trained on: every problem with its answer."""
    return [f"{a}+{b}={a + b}" for a in range(max_operand + 1) for b in range(0, max_operand + 1, 7)]


def reward(completion: str, answer: str) -> float:
    """1.0 when the completion is exactly the answer (surrounding whitespace ignored)."""
    return 1.0 if completion.strip() == answer else 0.0


def digit_reward(completion: str, answer: str) -> float:
    """Exact match earns 1.0; otherwise up to 0.5 for the digits that are right, aligned from the ones place
    (a longer or shorter number is penalised by its length). A denser signal than exact match alone: a group
    of near misses still ranks its samples, so fewer groups carry no gradient."""
    text = completion.strip()
    if text == answer:
        return 1.0
    if not text.isdigit():
        return 0.0
    right = sum(a == b for a, b in zip(reversed(text), reversed(answer)))
    return 0.5 * right / max(len(text), len(answer))
