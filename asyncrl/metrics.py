"""Monitor interface and sinks. Metric names are ``component/metric`` (``queue/depth``, ``sync/pause_s``...).

A JSONL sink is always available; TensorBoard and Weights & Biases sinks are used when their packages are
installed and the user asks for them (``"auto"`` = when installed).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)


class Monitor(Protocol):
    """Receives one dict of scalar metrics per learner step."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line: ``{"step": ..., "time": ..., <metric>: <value>}``. Flushed every line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, Any] = {"step": step, "time": time.time()}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, project: str, config: Mapping[str, Any] | None = None) -> None:
        import wandb

        self._run = wandb.init(project=project, config=dict(config or {}))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MultiMonitor:
    """Fans each step out to several sinks."""

    def __init__(self, sinks: list[Monitor]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class NullMonitor:
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


Choice = Literal["auto", "on", "off"]


def make_monitor(out_dir: str | Path, *, tensorboard: Choice = "auto", wandb: Choice = "off",
                 wandb_project: str = "asyncrl", config: Mapping[str, Any] | None = None) -> MultiMonitor:
    """JSONL at ``out_dir/metrics.jsonl`` plus the optional sinks that are wanted and installed."""
    sinks: list[Monitor] = [JsonlSink(Path(out_dir) / "metrics.jsonl")]
    if _wanted(tensorboard, "tensorboard"):
        sinks.append(TensorBoardSink(Path(out_dir) / "tensorboard"))
    if _wanted(wandb, "wandb"):
        sinks.append(WandbSink(wandb_project, config))
    return MultiMonitor(sinks)


def _wanted(choice: Choice, package: str) -> bool:
    installed = importlib.util.find_spec(package) is not None
    if choice == "on" and not installed:
        raise RuntimeError(f"the {package} sink was requested but {package} is not installed")
    return choice == "on" or (choice == "auto" and installed)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return value
