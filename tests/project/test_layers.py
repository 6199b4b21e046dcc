"""The package's layers hold: import-linter's contracts (pyproject.toml ``[tool.importlinter]``) say that no module
imports from a layer above its own, and that no two sibling modules import each other, directly or around a
circle. The layers are the ones docs/ARCHITECTURE.md draws; this test keeps the drawing and the code in step."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_no_module_imports_upward_and_siblings_form_no_circle():
    done = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"Contracts: \d+ kept, 0 broken", done.stdout), done.stdout[-2000:]


def test_the_architecture_doc_draws_the_contract_s_layers():
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    drawn = re.search(r"<!-- layers -->\n```\n(.*?)```", doc, re.S)
    assert drawn, "docs/ARCHITECTURE.md has no <!-- layers --> block"
    rows = [line.split("#")[0].strip() for line in drawn.group(1).splitlines() if line.split("#")[0].strip()]
    assert rows == contract["layers"], "docs/ARCHITECTURE.md's layers differ from pyproject.toml's contract"
