"""``python -m bench.report``: write docs/BENCHMARKS.md and the README's figure blocks, or check them."""

from __future__ import annotations

import argparse
import sys

from bench import common, report
from bench.report.document import DOC, render
from bench.report.readme import README, render_readme


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=report.__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    text, readme = render(), render_readme(README.read_text())
    if args.check:
        same = DOC.is_file() and DOC.read_text() == text and README.read_text() == readme
        print("docs/BENCHMARKS.md and README.md match the result files" if same else
              "docs/BENCHMARKS.md or README.md is out of date: run python -m bench.report")
        return 0 if same else 1
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    README.write_text(readme)
    print(f"wrote {DOC.relative_to(common.ROOT)} and the figure blocks of README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
