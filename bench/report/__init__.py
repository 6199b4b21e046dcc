"""``docs/BENCHMARKS.md`` and the figure blocks of README.md and docs/RESULTS.md, generated from the result
files: figures are never typed by hand.

    python -m bench.report            # write docs/BENCHMARKS.md
    python -m bench.report --check    # exit 1 if either differs from what the files give

Every ``bench/results/*.json`` gets a section: what it measures, the command that wrote it, the machine (CPU
model, cores, GPU), the load average, the versions and the date, then its headline figures. ``make test``
checks the document against the files (``tests/bench/test_benchmarks_doc.py``).

By role: ``document`` lays out docs/BENCHMARKS.md, ``readme`` the figure blocks; one
section module per kind of result formats its files' figures (``learning``, ``pipeline``, ``peers``, ``scaling``,
``gpu``), with the helpers in ``format``; ``__main__`` writes or checks both.
"""

from bench.report.document import DOC, render
from bench.report.readme import FIGURED, render_figures

__all__ = ["DOC", "FIGURED", "render", "render_figures"]
