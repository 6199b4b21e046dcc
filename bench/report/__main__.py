"""``python -m bench.report``: write docs/BENCHMARKS.md and the figure blocks of README.md and docs/RESULTS.md,
or check them."""

from __future__ import annotations

import argparse
import sys

from bench import common, report
from bench.report.document import DOC, render
from bench.report.readme import FIGURED, render_figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=report.__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    wanted = {DOC: render(), **{doc: render_figures(doc, doc.read_text()) for doc in FIGURED}}
    if args.check:
        stale = [doc for doc, text in wanted.items() if not doc.is_file() or doc.read_text() != text]
        print("out of date (run python -m bench.report): " + ", ".join(d.name for d in stale) if stale else
              "the documents match the result files")
        return 1 if stale else 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    for doc, text in wanted.items():
        doc.write_text(text)
    print("wrote " + ", ".join(str(d.relative_to(common.ROOT)) for d in wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
