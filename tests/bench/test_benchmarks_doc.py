"""docs/BENCHMARKS.md is generated from bench/results: the published tables can never drift from the files."""

from __future__ import annotations

from bench import report
from bench.gpu.workload_rates import fastest_trl


def test_the_benchmarks_document_matches_the_result_files():
    assert report.DOC.read_text() == report.render(), "docs/BENCHMARKS.md is stale: run python -m bench.report"


def test_the_figure_blocks_match_the_result_files():
    for doc in report.FIGURED:  # README.md and docs/RESULTS.md
        text = doc.read_text()
        assert text == report.render_figures(doc, text), f"{doc.name}'s figures are stale: run python -m bench.report"


def test_the_gpu_headline_compares_with_trls_fastest_mode():
    side = {"trl": {"samples_per_s": 11.5}, "trl_sleep": {"samples_per_s": 12.7}, "ours": {}}
    assert fastest_trl(side) == "trl_sleep"
    assert fastest_trl({**side, "trl": {"samples_per_s": 14.6}}) == "trl"
    assert fastest_trl({"trl": {"samples_per_s": 9.6}}) == "trl"
    assert fastest_trl({**side, "trl_sleep": {"error": "OOM"}}) == "trl", "a side that failed is no candidate"
    assert fastest_trl({"ours": {}}) is None
