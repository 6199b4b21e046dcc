"""Number and table formatting shared by the report's formatter modules."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench import common


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def spread(values: list[float], signed: bool = False) -> str:
    """Mean ± sample standard deviation, three decimals (sd 0 for a single value)."""
    mean = statistics.mean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:+.3f} ± {sd:.3f}" if signed else f"{num(mean, 3)} ± {num(sd, 3)}"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def first_sentences(error: str, limit: int = 5) -> str:
    """An error's first sentences: torch's out-of-memory message goes on with advice."""
    return ". ".join(error.split(". ")[:limit]).rstrip(".") + "."


def cite(path: Path, doc: dict[str, Any]) -> str:
    """How the docs cite a results file: the file, the machine that measured it (its GPU where it ran on one, else
    its CPU model), its date."""
    hw = doc["hardware"]
    return f"`{path.relative_to(common.ROOT)}`, {hw.get('gpu') or hw['cpu']}, {str(doc['date'])[:10]}"
