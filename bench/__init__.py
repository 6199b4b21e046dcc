"""Benchmarks, run as modules from the repository root, laid out by kind: ``bench.cpu`` (the pipeline on one
machine: ``python -m bench.cpu.<name>``; ``python -m bench.run_all`` runs them all), ``bench.gpu`` (GPU workloads,
probes and the ``run_*.sh`` scripts for an H200), ``bench.peers`` (TRL's sides and the comparisons with it) and
``bench.report`` (``docs/BENCHMARKS.md`` from the result files). ``bench/common.py`` holds what they share; results
land in ``bench/results/``."""
