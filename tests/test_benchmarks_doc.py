"""docs/BENCHMARKS.md is generated from bench/results: the published tables can never drift from the files."""

from __future__ import annotations

from bench import report


def test_the_benchmarks_document_matches_the_result_files():
    assert report.DOC.read_text() == report.render(), "docs/BENCHMARKS.md is stale: run python -m bench.report"


def test_the_readme_figures_match_the_result_files():
    text = report.README.read_text()
    assert text == report.render_readme(text), "README.md's figures are stale: run python -m bench.report"
