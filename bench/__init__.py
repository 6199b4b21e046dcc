"""Benchmarks, run as modules from the repository root: ``python -m bench.<name>`` (``python -m bench.run_all``
runs them all). ``bench/common.py`` holds what they share; results land in ``bench/results/``."""
