"""docs/BENCHMARKS.md is generated from bench/results: the published tables can never drift from the files."""

from __future__ import annotations

from bench import report


def test_the_benchmarks_document_matches_the_result_files():
    assert report.DOC.read_text() == report.render(), "docs/BENCHMARKS.md is stale: run python -m bench.report"
