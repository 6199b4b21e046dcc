"""GPU memory for the GPU benchmarks: peak use per device (all processes) sampled from a thread, and freeing
what this process holds between runs."""

from __future__ import annotations

import argparse
import gc
import threading
from contextlib import contextmanager
from typing import Any

from bench import common


class MemoryWatch:
    """Peak memory in use on each device (all processes), sampled every ``period_s`` from this process."""

    def __init__(self, devices: int, period_s: float = 0.2) -> None:
        self.devices, self.period_s = devices, period_s
        self.peak = [0.0] * devices
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import torch

        while not self._stop.is_set():
            for d in range(self.devices):
                free, total = torch.cuda.mem_get_info(d)
                self.peak[d] = max(self.peak[d], (total - free) / 2**30)
            self._stop.wait(self.period_s)

    @contextmanager
    def watching(self) -> Any:
        if not self.devices:
            yield self
            return
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


def watch(args: argparse.Namespace) -> MemoryWatch:
    if args.cpu_smoke or not common.on_gpu():
        return MemoryWatch(0)
    return MemoryWatch(2 if args.layout == "2gpu" else 1)


def free_gpu() -> None:
    gc.collect()
    if common.on_gpu():
        import torch

        torch.cuda.empty_cache()
