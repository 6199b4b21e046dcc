"""The package trees in README.md and docs/ARCHITECTURE.md are checked against the package: every module and
subpackage is named where it lives, and nothing is named that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "asyncrl"


def tree_block(doc: Path) -> list[str]:
    """The first fenced block of ``doc`` that starts with ``asyncrl/``."""
    for block in re.findall(r"```\n(asyncrl/\n.*?)```", doc.read_text(), flags=re.S):
        return block.splitlines()
    raise AssertionError(f"{doc.name} has no asyncrl/ tree")


def layout_entries(lines: list[str]) -> set[str]:
    """Paths named by an indented tree (two spaces a level): ``engines/vllm_local/engine.py``..."""
    found: set[str] = set()
    stack: list[str] = []
    for line in lines[1:]:
        name = line.strip().split(" ", 1)[0]
        if not name or not (name.endswith(".py") or name.endswith("/")):
            continue  # a wrapped description
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        stack = stack[:depth]
        path = "".join(stack) + name
        found.add(path.rstrip("/"))
        if name.endswith("/"):
            stack.append(name)
    return found


def package_entries(include_modules_below_top: bool) -> set[str]:
    out: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if "__pycache__" in rel.parts:
            continue
        for i in range(1, len(rel.parts)):
            out.add("/".join(rel.parts[:i]))
        if path.name != "__init__.py" and (include_modules_below_top or len(rel.parts) == 1):
            out.add(rel.as_posix())
    return out


def test_architecture_layout_names_every_module_where_it_lives():
    named = layout_entries(tree_block(ROOT / "docs" / "ARCHITECTURE.md"))
    actual = package_entries(include_modules_below_top=True)
    assert not actual - named, f"modules missing from ARCHITECTURE.md's layout: {sorted(actual - named)}"
    assert not named - actual - {"__init__.py"}, f"named but not in the package: {sorted(named - actual)}"


def test_readme_tree_names_every_subpackage_and_top_level_module():
    lines = tree_block(ROOT / "README.md")
    text = "\n".join(lines)
    actual = package_entries(include_modules_below_top=False)
    missing = sorted(p for p in actual if re.search(rf"(?<![\w/]){re.escape(Path(p).name)}\b", text) is None)
    assert not missing, f"README.md's package tree leaves out: {missing}"
