"""Checkpoints the learner can resume from: weights, optimiser state, step, version, data cursor, RNG states.

A checkpoint is a directory ``<dir>/step-000123`` holding ``model.safetensors``, ``optimizer.pt``,
``meta.json`` and, written last, a ``COMPLETE`` manifest with the sha256 of every other file. It is written
into a temporary directory ``<dir>/.tmp-step-000123-*`` (files and directory fsynced) and renamed into
place, so a process killed mid-write leaves a temporary directory that ``latest`` never returns. A
directory without ``COMPLETE`` or whose checksums do not match is skipped with a warning.

Tensors are copied to CPU on the event loop thread (so the next optimiser step cannot change them
mid-write); files are written in a worker thread while the pipeline keeps streaming. One write is in flight
at a time: the next save waits for it. One ``Checkpointer`` writes to a directory at a time.

Typical use (a fresh run and a resumed one are the same code)::

    async with Checkpointer(CheckpointConfig(dir="runs/x/ckpt", every_steps=50)) as ckpt:
        pipe, state = await resume_pipeline(engine, model, items, reward_fn, config,
                                            checkpoint=latest("runs/x/ckpt"), checkpointer=ckpt)
        await pipe.run(steps)

Data semantics: the cursor counts prompts handed out when the checkpoint was taken. Groups still queued or
being generated then are not replayed: on resume the source continues at the cursor and those groups are
counted as dropped (``unused_at_shutdown``), so the restored ledger still balances.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.actors.learner import Learner, StepHook
from asyncrl.actors.producer import RewardFn
from asyncrl.config import ConfigError, PipelineConfig
from asyncrl.data import PromptSource
from asyncrl.engines.base import Engine
from asyncrl.engines.weights import WEIGHTS_FILE, state_dict_for_engine
from asyncrl.ledger import GroupLedger
from asyncrl.pipeline import Pipeline
from asyncrl.recipes import grpo_pipeline
from asyncrl.types import DropReason, Prompt

log = logging.getLogger(__name__)

FORMAT = 1
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "COMPLETE"
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step-(\d+)$")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint directory is incomplete or does not match its manifest."""


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """Where and how often the learner is checkpointed."""

    dir: str | Path  # directory holding step-NNNNNN checkpoints; one writer at a time
    every_steps: int = 100  # optimiser steps between checkpoints
    keep: int = 3  # newest complete checkpoints kept; older ones are deleted after each save

    def __post_init__(self) -> None:
        if not isinstance(self.dir, (str, Path)) or not str(self.dir):
            raise ConfigError("CheckpointConfig.dir", f"must be a non-empty path, got {self.dir!r}")
        object.__setattr__(self, "dir", Path(self.dir))
        for name, low in (("every_steps", 1), ("keep", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"CheckpointConfig.{name}", f"must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint whose files matched their checksums when it was found."""

    path: Path
    step: int  # optimiser steps taken when it was saved
    meta: Mapping[str, Any]  # the parsed meta.json


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What ``restore`` read back, for building the resumed pipeline."""

    step: int  # optimiser steps taken
    version: int  # learner weight version when saved
    published: bool  # the saved weights are the ones published as ``version`` (else they are newer)
    cursor: int  # prompts handed out when saved; the resumed source starts here
    ledger: GroupLedger  # group counts, with groups lost with the old process counted as unused
    samples_trained: int  # rollouts that reached the loss
    extra: Mapping[str, Any]  # whatever the caller passed to ``save``
    path: Path


@dataclass(slots=True)
class _Snapshot:
    """CPU copies taken on the event loop thread; the writer thread reads only these."""

    step: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    meta: dict[str, Any]
    meta_json: str  # serialised on the event loop, so a bad ``extra`` fails the save call itself


@dataclass(slots=True)
class CheckpointStats:
    """Gauges of one ``Checkpointer``."""

    saves: int = 0
    last_step: int = -1  # step of the newest checkpoint written (-1: none yet)
    write_s: float = 0.0  # duration of the last write (worker thread), seconds
    snapshot_s: float = 0.0  # duration of the last snapshot (event loop), seconds
    wait_s: float = 0.0  # total time saves waited for the previous write, seconds
    pruned: list[str] = field(default_factory=list)  # names deleted by the last prune


class Checkpointer:
    """Writes checkpoints of a learner into ``config.dir`` and prunes old ones.

    Use as ``async with`` so a write still in flight is finished (and its error raised) at the end.
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.dir = Path(config.dir)
        self.stats = CheckpointStats()
        self.last: Checkpoint | None = None  # newest checkpoint this object wrote
        self._pending: asyncio.Task[Checkpoint] | None = None

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._pending is None:
            return
        try:
            await self.wait()
        except Exception:
            if exc is None:
                raise
            log.exception("checkpoint write failed while the run was already failing")

    async def save(self, learner: Learner, source: PromptSource, extra: Mapping[str, Any] | None = None
                   ) -> Checkpoint:
        """Checkpoint now and return once it is complete on disk."""
        await self.start_save(learner, source, extra)
        checkpoint = await self.wait()
        assert checkpoint is not None
        return checkpoint

    async def start_save(self, learner: Learner, source: PromptSource, extra: Mapping[str, Any] | None = None
                         ) -> None:
        """Snapshot now and write in the background (after waiting for the previous write, if any)."""
        t0 = time.perf_counter()
        await self.wait()
        t1 = time.perf_counter()
        snapshot = _snapshot(learner, source, extra or {})
        self.stats.wait_s += t1 - t0
        self.stats.snapshot_s = time.perf_counter() - t1
        self._pending = asyncio.create_task(self._write_in_thread(snapshot), name=f"checkpoint-{snapshot.step}")

    async def wait(self) -> Checkpoint | None:
        """Finish the write in flight (raising its error); the newest checkpoint written, if any.

        Cancelling the caller does not cancel the write: it stays pending for the next ``wait``."""
        task = self._pending
        if task is not None:
            try:
                await asyncio.shield(task)
            finally:
                if task.done():
                    self._pending = None
        return self.last

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {"checkpoint/saves": s.saves, "checkpoint/last_step": s.last_step, "checkpoint/write_s": s.write_s,
                "checkpoint/snapshot_s": s.snapshot_s, "checkpoint/wait_s": s.wait_s}

    async def _write_in_thread(self, snapshot: _Snapshot) -> Checkpoint:
        t0 = time.perf_counter()
        checkpoint = await asyncio.to_thread(self._write, snapshot)
        self.stats.write_s = time.perf_counter() - t0
        self.stats.saves += 1
        self.stats.last_step = checkpoint.step
        self.last = checkpoint
        return checkpoint

    def _write(self, snapshot: _Snapshot) -> Checkpoint:
        """Worker thread: temp dir -> files (fsynced) -> COMPLETE manifest -> rename -> prune."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"step-{snapshot.step:06d}"
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=self.dir))
        try:
            from safetensors.torch import save_file

            sums = {
                WEIGHTS_FILE: self._write_file(tmp / WEIGHTS_FILE, lambda p: save_file(snapshot.weights, str(p))),
                OPTIMIZER_FILE: self._write_file(tmp / OPTIMIZER_FILE, lambda p: torch.save(snapshot.optimizer, p)),
                META_FILE: self._write_file(tmp / META_FILE, lambda p: p.write_text(snapshot.meta_json)),
            }
            manifest = {"format": FORMAT, "step": snapshot.step, "files": sums}
            self._write_file(tmp / MANIFEST_FILE, lambda p: p.write_text(json.dumps(manifest, indent=1)))
            _fsync_dir(tmp)
            final = self.dir / name
            _move_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(self.dir)
        self._prune()
        log.info("checkpoint saved: %s", final)
        return Checkpoint(final, snapshot.step, snapshot.meta)

    def _write_file(self, path: Path, write: Callable[[Path], object]) -> str:
        """Write one file, fsync it, and return its sha256."""
        write(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return _sha256(path)

    def _prune(self) -> None:
        complete = sorted((s, p) for s, p in _step_dirs(self.dir) if (p / MANIFEST_FILE).is_file())
        doomed = [p for _, p in complete[: max(0, len(complete) - self.config.keep)]]
        # Unfinished writes of an earlier (killed) process: only one writer uses a directory.
        doomed += [p for p in self.dir.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir()]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        self.stats.pruned = [p.name for p in doomed]


def latest(directory: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint in ``directory`` whose checksums match, or None.

    Unfinished writes (temporary directories), directories without a ``COMPLETE`` manifest and directories
    whose files do not match it are skipped with a warning naming them.
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    for path in sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)):
        log.warning("ignoring unfinished checkpoint write %s", path)
    for _, path in sorted(_step_dirs(root), reverse=True):
        try:
            return verify(path)
        except CorruptCheckpoint as exc:
            log.warning("ignoring checkpoint %s: %s", path, exc)
    return None


def verify(path: str | Path) -> Checkpoint:
    """Check a checkpoint directory against its manifest; raises ``CorruptCheckpoint``."""
    path = Path(path)
    match = _NAME.match(path.name)
    if match is None:
        raise CorruptCheckpoint(f"{path.name} is not a step-NNNNNN checkpoint directory")
    if not path.is_dir():
        raise CorruptCheckpoint(f"{path} does not exist")
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        files: dict[str, str] = manifest["files"]
    except FileNotFoundError:
        raise CorruptCheckpoint("no COMPLETE manifest (torn write)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"unreadable COMPLETE manifest: {exc!r}") from None
    for required in (WEIGHTS_FILE, OPTIMIZER_FILE, META_FILE):
        if required not in files:
            raise CorruptCheckpoint(f"manifest does not list {required}")
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if _sha256(file) != digest:
            raise CorruptCheckpoint(f"{name} does not match its checksum")
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("step") != int(match.group(1)):
        raise CorruptCheckpoint(f"meta.json says step {meta.get('step')}, the directory says {match.group(1)}")
    return Checkpoint(path, meta["step"], meta)


def restore(checkpoint: Checkpoint | str | Path, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> ResumeState:
    """Load weights (and optimiser state) in place, restore the RNG states, and return the run's position."""
    from safetensors.torch import load_file

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else verify(checkpoint)
    meta = ckpt.meta
    tensors = load_file(str(ckpt.path / WEIGHTS_FILE))
    for alias, target in meta.get("aliases", {}).items():
        tensors[alias] = tensors[target]
    model.load_state_dict(tensors, strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(ckpt.path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    _set_rng_state(meta["rng"])
    log.info("restored %s: step %d, version %d, cursor %d", ckpt.path, ckpt.step, meta["version"], meta["cursor"])
    return ResumeState(step=meta["step"], version=meta["version"], published=meta["published"],
                       cursor=meta["cursor"], ledger=_restored_ledger(meta), samples_trained=meta["samples_trained"],
                       extra=meta.get("extra", {}), path=ckpt.path)


def checkpoint_hook(checkpointer: Checkpointer, learner: Learner, source: PromptSource) -> StepHook:
    """A learner hook that checkpoints every ``every_steps`` steps (writing in the background) and adds
    ``checkpoint/*`` gauges to each step's metrics."""
    every = checkpointer.config.every_steps
    if every % learner.config.sync.every:
        log.warning("checkpoints every %d steps fall between weight syncs (every %d): a resumed run publishes "
                    "its weights as a new version", every, learner.config.sync.every)

    async def hook(step: int, metrics: dict[str, float]) -> None:
        if step % every == 0:
            await checkpointer.start_save(learner, source)
        metrics.update(checkpointer.metrics())

    return hook


async def resume_pipeline(engine: Engine, model: torch.nn.Module, items: Iterable[Prompt] | AsyncIterable[Prompt],
                          reward_fn: RewardFn, config: PipelineConfig | None = None, *,
                          checkpoint: Checkpoint | str | Path | None, checkpointer: Checkpointer | None = None,
                          **kwargs: Any) -> tuple[Pipeline, ResumeState | None]:
    """A ``grpo_pipeline`` continuing from ``checkpoint`` (None: a fresh run), ready to ``run()``.

    ``items`` is the full prompt stream, as given to the original run; it is skipped to the checkpoint's
    cursor. Weights and optimiser state are restored into ``model`` and the pipeline's optimiser, the
    group ledger continues, and the restored weights are published to ``engine`` (pause -> update ->
    resume, through the learner's ``WeightSync``) under the checkpoint's version. With ``checkpointer``,
    the pipeline checkpoints itself every ``every_steps`` steps. ``kwargs`` go to ``grpo_pipeline``.
    """
    if isinstance(items, PromptSource):
        raise TypeError("resume_pipeline needs the raw prompt stream (it positions the PromptSource itself)")
    ckpt = verify(checkpoint) if isinstance(checkpoint, (str, Path)) else checkpoint
    meta = ckpt.meta if ckpt else {"cursor": 0, "version": 0, "step": 0}
    source = PromptSource(items, start=meta["cursor"])
    pipe = grpo_pipeline(engine, model, source, reward_fn, config, version=meta["version"], step=meta["step"],
                         **kwargs)
    state = None
    if ckpt is not None:
        state = restore(ckpt, pipe.learner.model, pipe.learner.optimizer)
        _continue_books(pipe, state)
        # Weights saved between syncs are newer than the version they were saved under.
        version = state.version if state.published else state.version + 1
        await pipe.learner.weight_sync.publish(state_dict_for_engine(pipe.learner.model), version)
        pipe.learner.version = version
    if checkpointer is not None:
        pipe.learner.hooks.append(checkpoint_hook(checkpointer, pipe.learner, source))
    return pipe, state


def _continue_books(pipe: Pipeline, state: ResumeState) -> None:
    ledger = pipe.queue.ledger
    ledger.queued, ledger.trained = state.ledger.queued, state.ledger.trained
    ledger.dropped = Counter(state.ledger.dropped)
    ledger.dropped_before_queue = state.ledger.dropped_before_queue
    pipe.learner.samples_trained = state.samples_trained


def _snapshot(learner: Learner, source: PromptSource, extra: Mapping[str, Any]) -> _Snapshot:
    """Event loop thread, no awaits: a consistent copy of everything a checkpoint holds."""
    weights, aliases = _cpu_state(learner.model)
    ledger = learner.queue.ledger
    meta = {
        "format": FORMAT, "step": learner.step, "version": learner.version,
        "published": learner.step % learner.config.sync.every == 0,
        "cursor": source.cursor, "queue_depth": learner.queue.depth,
        # Prompts handed out that are neither queued nor dropped yet: groups being generated.
        "in_flight": max(0, source.cursor - ledger.queued - ledger.dropped_before_queue),
        "ledger": {"queued": ledger.queued, "trained": ledger.trained,
                   "dropped": {r.value: c for r, c in ledger.dropped.items()},
                   "dropped_before_queue": ledger.dropped_before_queue},
        "samples_trained": learner.samples_trained, "aliases": aliases, "rng": _rng_state(),
        "extra": dict(extra), "time": time.time(), "torch": torch.__version__,
    }
    return _Snapshot(learner.step, weights, _clone_tree(learner.optimizer.state_dict()), meta, json.dumps(meta))


def _cpu_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """CPU copies of the state dict; tensors sharing storage (tied weights) are stored once."""
    weights: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()))
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        weights[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return weights, aliases


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def _restored_ledger(meta: Mapping[str, Any]) -> GroupLedger:
    saved = meta["ledger"]
    ledger = GroupLedger(queued=saved["queued"], trained=saved["trained"],
                         dropped=Counter({DropReason(r): c for r, c in saved["dropped"].items()}),
                         dropped_before_queue=saved["dropped_before_queue"])
    # Groups queued or in flight in the process that saved are not replayed.
    ledger.drop(DropReason.UNUSED_AT_SHUTDOWN, meta["queue_depth"], queued=True)
    ledger.drop(DropReason.UNUSED_AT_SHUTDOWN, meta["in_flight"], queued=False)
    ledger.dropped += Counter()  # drop zero counts
    return ledger


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": _jsonable(random.getstate()), "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state:
        if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])
        else:
            log.warning("checkpoint has CUDA RNG states for %d devices; not restored here", len(state["cuda"]))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _jsonable(obj: Any) -> Any:
    return [_jsonable(v) for v in obj] if isinstance(obj, (tuple, list)) else obj


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (a re-run of that step) is replaced."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{os.getpid()}")
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
