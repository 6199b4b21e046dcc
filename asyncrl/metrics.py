"""Monitor interface and sinks. Metric names are ``component/metric`` (``queue/depth``, ``sync/pause_s``...).

A JSONL sink is always available; TensorBoard and Weights & Biases sinks are used when their packages are
installed and the user asks for them (``"auto"`` = when installed). ``ProgressLine`` prints one short line per
step to stderr (a ``Pipeline`` adds it unless ``PipelineConfig.progress`` is off).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

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
    def __init__(self, project: str, config: Mapping[str, Any] | None = None, name: str | None = None) -> None:
        import wandb

        self._run = wandb.init(project=project, name=name, config=dict(config or {}))

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


class ProgressLine:
    """One short line per learner step, for a person watching a run: on stderr by default, so a program
    reading the run's stdout is not disturbed. Rates are over the time since the previous line."""

    def __init__(self, stream: TextIO | None = None, clock: Any = time.monotonic) -> None:
        self.stream = stream  # None: sys.stderr as it is when a line is printed
        self._clock = clock
        self._last: tuple[float, float, int] | None = None  # (time, tokens trained, step) at the last line

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now, tokens = self._clock(), float(metrics.get("tokens/trained", 0.0))
        rates = None
        if self._last is not None and now > self._last[0]:
            elapsed = now - self._last[0]
            rates = ((tokens - self._last[1]) / elapsed, (step - self._last[2]) / elapsed)
        self._last = (now, tokens, step)
        print(progress_line(step, metrics, rates), file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress_line(step: int, metrics: Mapping[str, float], rates: tuple[float, float] | None = None) -> str:
    """``step 12 | v 12 | groups 24 | reward 0.42 | staleness 0.50 | 1520 tok/s 2.10 steps/s | dropped 3``:
    what the learner logged for ``step`` (a figure it did not log is left out); ``rates``: trained tokens and
    steps per second."""
    parts = [f"step {step}"]
    for key, label, form in (("learner/version", "v", "{:.0f}"), ("groups/trained", "groups", "{:.0f}"),
                             ("train/reward_mean", "reward", "{:.3g}"),
                             ("rollout/staleness_batch_mean", "staleness", "{:.2f}"),
                             ("eval/accuracy", "eval", "{:.3f}")):
        if key in metrics:
            parts.append(f"{label} {form.format(float(metrics[key]))}")
    if rates is not None:
        parts.append(f"{rates[0]:.0f} tok/s {rates[1]:.2f} steps/s")
    if metrics.get("groups/dropped"):
        parts.append(f"dropped {float(metrics['groups/dropped']):.0f}")
    return " | ".join(parts)


class NullMonitor:
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


Choice = Literal["auto", "on", "off"]


def make_monitor(out_dir: str | Path, *, tensorboard: Choice = "auto", wandb: Choice = "off",
                 wandb_project: str = "asyncrl", config: Mapping[str, Any] | None = None,
                 wandb_run_name: str | None = None) -> MultiMonitor:
    """JSONL at ``out_dir/metrics.jsonl`` plus the optional sinks that are wanted and installed. A sink asked
    for with ``"on"`` whose package is missing raises ``RuntimeError`` naming the extra that installs it."""
    use_tensorboard, use_wandb = optional_sinks(tensorboard, wandb)
    sinks: list[Monitor] = [JsonlSink(Path(out_dir) / "metrics.jsonl")]
    if use_tensorboard:
        sinks.append(TensorBoardSink(Path(out_dir) / "tensorboard"))
    if use_wandb:
        sinks.append(WandbSink(wandb_project, config, name=wandb_run_name))
    return MultiMonitor(sinks)


def optional_sinks(tensorboard: Choice = "auto", wandb: Choice = "off") -> tuple[bool, bool]:
    """Whether the TensorBoard and W&B sinks will be used; raises ``RuntimeError`` for one asked for (``"on"``)
    that is not installed. Cheap: a command line can check its flags before any slow start-up."""
    return _wanted(tensorboard, "tensorboard"), _wanted(wandb, "wandb")


def _wanted(choice: Choice, package: str) -> bool:
    installed = importlib.util.find_spec(package) is not None
    if choice == "on" and not installed:
        raise RuntimeError(f"the {package} sink was asked for but {package} is not installed: "
                           f"pip install 'asyncrl[{package}]'")
    return choice == "on" or (choice == "auto" and installed)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    return value
