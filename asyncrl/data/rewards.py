"""Rewards for problems with a reference answer, and reward functions named on a command line.

A reward function for the pipeline is the library's ``RewardFn``: ``reward_fn(prompt, sample) -> float``
(or an ``async`` one), with ``prompt`` an ``asyncrl.Prompt`` (its ``answer`` is the reference) and ``sample``
an ``asyncrl.Sample`` (``sample.text`` is the completion). ``load_reward("pkg.module:function")`` loads one.
``answer_reward(completion, answer)`` scores text against a reference; ``reward_fn = lambda prompt, sample:
answer_reward(sample.text, prompt.answer)`` makes it a ``RewardFn``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def reference_answer(answer: str) -> str:
    """The part of ``answer`` a completion must match: the text after the last ``####`` (GSM8K's solution
    format) when there is one, else the whole answer, stripped."""
    return answer.rsplit("####", 1)[-1].strip() if "####" in answer else answer.strip()


def answer_reward(completion: str, answer: str) -> float:
    """1.0 when the stripped completion equals the reference answer (``reference_answer``), else 0.0.

    When the reference is a number (GSM8K: ``"72"`` or ``"... #### 72"``), the last number in the completion
    is compared with it instead (commas ignored), as GSM8K's "flexible" scoring does.
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


def load_reward(spec: str) -> Callable[[Any, Any], Any]:
    """The function ``spec`` names, ``"package.module:function"`` (a dotted attribute path after the colon
    works too: ``"module:Class.method"``). It must take ``(prompt, sample)`` and return a float, as the
    library's ``RewardFn``. Every way this can fail is a ``ValueError`` saying which."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"reward {spec!r}: {attr!r} is a {type(target).__name__}, not callable")
    try:
        inspect.signature(target).bind(None, None)
    except TypeError:
        raise ValueError(f"reward {spec!r}: {attr!r} must take two arguments, (prompt, sample)") from None
    except ValueError:
        pass  # no signature to check (some builtins): the first call will tell
    return target
