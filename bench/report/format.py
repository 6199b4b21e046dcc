"""Number and table formatting shared by the report's formatter modules."""

from __future__ import annotations


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def first_sentences(error: str, limit: int = 5) -> str:
    """An error's first sentences: torch's out-of-memory message goes on with advice."""
    return ". ".join(error.split(". ")[:limit]).rstrip(".") + "."
