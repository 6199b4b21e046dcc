"""The library stays small enough to live in: no module over 400 lines, no function over 60, no line over 120.
Tests, benches and examples are held to ruff's complexity lints instead (``make test`` runs ``ruff check``;
pyproject.toml's [tool.ruff.lint]): splitting them to meet a line count is not the goal."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("asyncrl",)
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_LINE = 120  # as pyproject.toml's [tool.ruff] line-length


def _too_long(path: Path) -> list[str]:
    source = path.read_text()
    name = path.relative_to(ROOT)
    lines = source.splitlines()
    found = [f"{name}: {len(lines)} lines"] if len(lines) > MAX_MODULE_LINES else []
    found += [f"{name}:{i} is {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > MAX_LINE]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_modules_functions_and_lines_are_small():
    # The runnable examples ship inside the package (so a pip install has them) but are example programs.
    paths = sorted(p for top in CODE for p in (ROOT / top).rglob("*.py") if "examples" not in p.parts)
    assert len(paths) > 50, "the code was not found"
    too_long = [entry for path in paths for entry in _too_long(path)]
    assert not too_long, "\n".join(too_long)
