"""Every Python block in README.md and docs/ is declared by the comment above it, and checked as declared:

- ``<!-- snippet: run -->``: a complete program, run as written (``python snippet.py`` in an empty directory);
- ``<!-- snippet: module -->``: a module of definitions, imported (its imports and names must resolve);
- ``<!-- snippet: fragment -->``: a part of a larger program (names defined elsewhere, ``await`` at the top),
  compiled.

A block without the comment fails the first test, so no new snippet goes unchecked."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!-- snippet: (\w+) -->\n)?```python\n(.*?)```", re.S)


def snippets() -> list[tuple[str, str, str]]:
    """(id, kind, code) of every Python block; kind is '' where the comment is missing."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start(2))
            found.append((f"{doc.name}:{line}", m.group(1) or "", m.group(2)))
    return found


def of_kind(kind: str) -> list:
    return [pytest.param(code, id=name) for name, k, code in snippets() if k == kind]


def test_every_python_block_declares_what_it_is():
    assert len(snippets()) >= 8, "the docs' snippets were not found"
    undeclared = [name for name, kind, _ in snippets() if kind not in ("run", "module", "fragment")]
    assert not undeclared, f"Python blocks without <!-- snippet: run|module|fragment -->: {undeclared}"
    assert of_kind("run"), "no runnable snippet: README's first program must be one"


@pytest.mark.parametrize("code", of_kind("fragment"))
def test_fragments_compile(code):
    compile(code, "<snippet>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)  # often the body of an async def


@pytest.mark.parametrize("code", of_kind("module"))
def test_modules_import(code, tmp_path):
    path = tmp_path / "snippet_module.py"
    path.write_text(code)
    done = subprocess.run([sys.executable, "-c", "import snippet_module"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.vllm
@pytest.mark.parametrize("code", of_kind("run"))
def test_programs_run_as_written(code, tmp_path):
    """In an empty directory, as a user who pasted it into a file: exit 0, and the run's numbers printed."""
    path = tmp_path / "program.py"
    path.write_text(code)
    done = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip(), "the program printed nothing"
