"""The checkpoint store: format, write, verify, restore. It knows models, optimisers and a ``TrainingState``,
never the actors (``checkpoint.resume`` wires it to a pipeline).

A checkpoint is a directory ``<dir>/step-000123`` holding ``model.safetensors`` (a LoRA policy's:
``adapter.safetensors``, the adapter alone, ``meta.json`` saying ``"weights": "adapter"``), ``optimizer.pt``,
``meta.json`` and, written last, a ``COMPLETE`` manifest with the sha256 of every other file. It is written
into a temporary directory ``<dir>/.tmp-step-000123-*`` (files and directory fsynced) and renamed into
place, so a process killed mid-write leaves a temporary directory that ``latest`` never returns. A
directory without ``COMPLETE`` or whose checksums do not match is skipped with a warning.

``start_save`` copies the tensors to CPU in a worker thread (the caller must not step the optimiser until it
returns) and writes the files in the background; one write is in flight at a time. One ``Checkpointer``
writes to a directory at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import Field, field_validator

from asyncrl.aio import TaskOwner, settle
from asyncrl.checkpoint.files import TMP_PREFIX, fsync_dir, move_into_place, sha256, write_file
from asyncrl.checkpoint.rng import rng_state, set_rng_state
from asyncrl.checkpoint.weights import ADAPTER_FILE, WEIGHTS_FILE, cpu_weights, load_weights
from asyncrl.config_base import PositiveInt, config
from asyncrl.counters import Drops, GroupTotals
from asyncrl.types import DropReason

log = logging.getLogger(__name__)

FORMAT = 2  # 2: group counters under "counters" (format 1 called them the ledger)
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "COMPLETE"
_NAME = re.compile(r"^step-(\d+)$")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint directory is incomplete or does not match its manifest."""


@config
class CheckpointConfig:
    """Where and how often the learner is checkpointed."""

    dir: Annotated[Path, Field(description="directory holding step-NNNNNN checkpoints; one writer at a time")]
    every_steps: Annotated[PositiveInt, Field(description="optimiser steps between checkpoints")] = 100
    keep: Annotated[PositiveInt, Field(description=(
        "newest complete checkpoints kept; older ones are deleted after each save"))] = 3

    @field_validator("dir", mode="before")
    @classmethod
    def _non_empty(cls, value: object) -> object:
        if not isinstance(value, str | Path) or not str(value):
            raise ValueError(f"must be a non-empty path, got {value!r}")
        return value


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint whose files matched their checksums when it was found."""

    path: Path
    step: int  # optimiser steps taken when it was saved
    meta: Mapping[str, Any]  # the parsed meta.json


@dataclass(frozen=True, slots=True)
class TrainingState:
    """Where a run stands, besides its weights and optimiser: what a checkpoint records."""

    step: int  # optimiser steps taken
    version: int  # the weight version the engines serve
    published: bool  # the weights being saved are exactly the ones served as ``version`` (else newer)
    cursor: int  # prompts handed out; a resumed source starts here
    counters: GroupTotals  # the pipeline's books, added up (``Learner.totals``)
    queue_depth: int = 0  # groups queued and not trained: lost with this process
    in_flight: int = 0  # groups being generated or scored: lost with this process
    extra: Mapping[str, Any] = field(default_factory=dict)  # anything JSON-serialisable the caller adds


@dataclass(frozen=True, slots=True)
class ResumeState:
    """What ``restore`` read back, for building the resumed pipeline."""

    step: int  # optimiser steps taken
    version: int  # weight version the engines served when saved
    published: bool  # the saved weights are the ones published as ``version`` (else they are newer)
    cursor: int  # prompts handed out when saved; the resumed source starts here
    counters: GroupTotals  # the saved totals, with groups lost with the old process counted as unused
    extra: Mapping[str, Any]  # whatever the caller put in ``TrainingState.extra``
    path: Path


@dataclass(slots=True)
class _Snapshot:
    """CPU copies taken on the event loop thread; the writer thread reads only these."""

    step: int
    weights: dict[str, torch.Tensor]
    weights_file: str  # WEIGHTS_FILE, or ADAPTER_FILE for a LoRA policy's adapter alone
    optimizer: dict[str, Any]
    meta: dict[str, Any]
    meta_json: str  # serialised on the event loop, so a bad ``extra`` fails the save call itself


@dataclass(slots=True)
class CheckpointCounters:
    """Gauges of one ``Checkpointer``."""

    saves: int = 0
    last_step: int = -1  # step of the newest checkpoint written (-1: none yet)
    write_s: float = 0.0  # duration of the last write (worker thread), seconds
    snapshot_s: float = 0.0  # duration of the last snapshot (CPU copies, worker thread), seconds
    wait_s: float = 0.0  # total time saves waited for the previous write, seconds
    pruned: list[str] = field(default_factory=list)  # names deleted by the last prune


class Checkpointer:
    """Writes checkpoints of a learner into ``config.dir`` and prunes old ones.

    Use as ``async with``: the block owns the background write (a task of its ``TaskOwner``), which is finished
    (and its error raised) at the end, even when the block is left by a cancellation: a write in a thread
    cannot be cut short safely, so the write is awaited to its end rather than cancelled.
    """

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.dir = Path(config.dir)
        self.counters = CheckpointCounters()
        self.last: Checkpoint | None = None  # newest checkpoint this object wrote
        self._pending: asyncio.Task[Checkpoint] | None = None  # the write in flight
        self._writes = TaskOwner("checkpoint")

    async def __aenter__(self) -> Checkpointer:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._pending is None:
            return
        try:
            await settle(self.wait(), "the checkpoint write in flight")
        except Exception:
            if exc is None:
                raise
            log.exception("checkpoint write failed while the run was already failing")
        finally:
            await self._writes.aclose()  # finished above: nothing is left to cancel

    async def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainingState
                   ) -> Checkpoint:
        """Checkpoint now and return once it is complete on disk."""
        await self.start_save(model, optimizer, state)
        checkpoint = await self.wait()
        assert checkpoint is not None
        return checkpoint

    async def start_save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: TrainingState) -> None:
        """Snapshot now (CPU copies, in a worker thread) and write in the background, after waiting for the
        previous write. The caller must not change the model until this returns."""
        t0 = time.perf_counter()
        await self.wait()
        t1 = time.perf_counter()
        meta_json = json.dumps(state_meta(state))  # here, so a bad ``extra`` fails this call
        snapshot = await asyncio.to_thread(_snapshot, model, optimizer, state, meta_json)
        self.counters.wait_s += t1 - t0
        self.counters.snapshot_s = time.perf_counter() - t1
        self._pending = self._writes.start(self._write_in_thread(snapshot), name=f"checkpoint-{snapshot.step}")

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
        s = self.counters
        return {"checkpoint/saves": s.saves, "checkpoint/last_step": s.last_step, "checkpoint/write_s": s.write_s,
                "checkpoint/snapshot_s": s.snapshot_s, "checkpoint/wait_s": s.wait_s}

    async def _write_in_thread(self, snapshot: _Snapshot) -> Checkpoint:
        t0 = time.perf_counter()
        checkpoint = await asyncio.to_thread(self._write, snapshot)
        self.counters.write_s = time.perf_counter() - t0
        self.counters.saves += 1
        self.counters.last_step = checkpoint.step
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
                snapshot.weights_file: self._write_file(tmp / snapshot.weights_file,
                                                        lambda p: save_file(snapshot.weights, str(p))),
                OPTIMIZER_FILE: self._write_file(tmp / OPTIMIZER_FILE, lambda p: torch.save(snapshot.optimizer, p)),
                META_FILE: self._write_file(tmp / META_FILE, lambda p: p.write_text(snapshot.meta_json)),
            }
            manifest = {"format": FORMAT, "step": snapshot.step, "files": sums}
            self._write_file(tmp / MANIFEST_FILE, lambda p: p.write_text(json.dumps(manifest, indent=1)))
            fsync_dir(tmp)
            final = self.dir / name
            move_into_place(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(self.dir)
        self._prune()
        log.info("checkpoint saved: %s", final)
        return Checkpoint(final, snapshot.step, snapshot.meta)

    def _write_file(self, path: Path, write: Callable[[Path], object]) -> str:
        return write_file(path, write)

    def _prune(self) -> None:
        complete = sorted((s, p) for s, p in _step_dirs(self.dir) if (p / MANIFEST_FILE).is_file())
        doomed = [p for _, p in complete[: max(0, len(complete) - self.config.keep)]]
        # Unfinished writes of an earlier (killed) process: only one writer uses a directory.
        doomed += [p for p in self.dir.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir()]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        self.counters.pruned = [p.name for p in doomed]


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
    _check_files(path, _read_manifest(path))
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("step") != int(match.group(1)):
        raise CorruptCheckpoint(f"meta.json says step {meta.get('step')}, the directory says {match.group(1)}")
    return Checkpoint(path, meta["step"], meta)


def _read_manifest(path: Path) -> dict[str, str]:
    """The manifest's file -> checksum map; ``CorruptCheckpoint`` for a torn write or another format."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        files: dict[str, str] = manifest["files"]
        if manifest.get("format") != FORMAT:
            raise CorruptCheckpoint(f"format {manifest.get('format')!r}; this build reads format {FORMAT}")
    except FileNotFoundError:
        raise CorruptCheckpoint("no COMPLETE manifest (torn write)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"unreadable COMPLETE manifest: {exc!r}") from None
    return files


def _check_files(path: Path, files: dict[str, str]) -> None:
    for required in (OPTIMIZER_FILE, META_FILE):
        if required not in files:
            raise CorruptCheckpoint(f"manifest does not list {required}")
    if WEIGHTS_FILE not in files and ADAPTER_FILE not in files:
        raise CorruptCheckpoint(f"manifest lists neither {WEIGHTS_FILE} nor {ADAPTER_FILE}")
    for name, digest in files.items():
        file = path / name
        if not file.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if sha256(file) != digest:
            raise CorruptCheckpoint(f"{name} does not match its checksum")


def restore(checkpoint: Checkpoint | str | Path, model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> ResumeState:
    """Load weights (and optimiser state) in place, restore the RNG states, and return the run's position. A LoRA
    checkpoint holds the adapter alone: ``model`` must be the same base wrapped by ``asyncrl.lora.apply_lora``
    with the same ``LoraConfig``."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else verify(checkpoint)
    meta = ckpt.meta
    load_weights(ckpt.path, meta, model)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(ckpt.path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    set_rng_state(meta["rng"])
    log.info("restored %s: step %d, version %d, cursor %d", ckpt.path, ckpt.step, meta["version"], meta["cursor"])
    return ResumeState(step=meta["step"], version=meta["version"], published=meta["published"],
                       cursor=meta["cursor"], counters=restored_counters(meta), extra=meta.get("extra", {}),
                       path=ckpt.path)


def state_meta(state: TrainingState) -> dict[str, Any]:
    """``state`` as a checkpoint's JSON meta (also what a sharded checkpoint records)."""
    c = state.counters
    return {
        "format": FORMAT, "step": state.step, "version": state.version, "published": state.published,
        "cursor": state.cursor, "queue_depth": state.queue_depth, "in_flight": state.in_flight,
        "counters": {"queued": c.queued, "trained": c.trained, "dropped": {r.value: n for r, n in c.dropped.items()},
                     "dropped_before_queue": c.dropped_before_queue},
        "samples_trained": c.samples_trained, "rng": rng_state(), "extra": dict(state.extra),
        "time": time.time(), "torch": torch.__version__,
    }


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainingState,
              meta_json: str) -> _Snapshot:
    """A consistent CPU copy of everything a checkpoint holds (worker thread; the model is not stepping)."""
    weights, name, about = cpu_weights(model)
    meta = {**json.loads(meta_json), **about}
    return _Snapshot(state.step, weights, name, _clone_tree(optimizer.state_dict()), meta, json.dumps(meta))


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return obj


def restored_counters(meta: Mapping[str, Any]) -> GroupTotals:
    """The totals a resumed run continues from (``Ledger.carry``): the saved ones, with the groups that were
    queued or being generated in the process that saved counted as unused (they are not replayed)."""
    saved = meta["counters"]
    dropped = Drops({DropReason(r): c for r, c in saved["dropped"].items()})
    dropped.add(DropReason.UNUSED_AT_SHUTDOWN, meta["queue_depth"] + meta["in_flight"])
    return GroupTotals(queued=saved["queued"], trained=saved["trained"], samples_trained=meta["samples_trained"],
                       dropped=dropped, dropped_before_queue=saved["dropped_before_queue"] + meta["in_flight"])


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]


