"""Side by side with TRL: ``python -m bench.peers.vs_trl``, TRL's sides run in TRL's own interpreter
(``trl_side``, ``trl_async_side``: only the standard library at module level, this package's ``__init__`` too)
and the TRL sides of ``bench.gpu.workload`` (``workload_trl``)."""
