"""GPU benchmarks and GPU-host helpers: ``python -m bench.gpu.workload`` (its task ``countdown``, ``workload_task``,
``workload_rates``, ``memory``), the learner's speed and profile, ``python -m bench.gpu.build_qwen05``,
``python -m bench.gpu.startup_probe`` and the ``bench/gpu/run_*.sh`` scripts that run the benchmarks on an H200."""
