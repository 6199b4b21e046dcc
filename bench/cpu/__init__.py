"""The pipeline's benchmarks on one machine, run on the CPU by default (``python -m bench.cpu.<name>``; the
``bench/gpu/run_*.sh`` scripts run some of them on an H200): engine limit, queue layer, weight sync, async vs
sync, contention, learning, tool use, demo seeds, and the simulated scale-out."""
