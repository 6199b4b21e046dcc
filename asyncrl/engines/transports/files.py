"""Staged files: the update is written once as safetensors in shared memory before the pause, and the engine's
workers reload it under the pause. The transport that works everywhere: vLLM on CPU (where ``load_weights`` after
start-up has no effect, see ``vllm_local.worker_ext``) and vLLM servers on the same host.

Files already staged (by the first engine of a pool, or by a sharded learner's rank 0) are adopted as they are,
after checking their names, shapes and dtypes against the engine's model (file headers only, no tensor data).
A reload that fails part-way is undone by reloading the last good weights in full (``restore_good_weights``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path

import torch

from asyncrl.engines.common import restore_good_weights
from asyncrl.engines.transports.base import FULL_ONLY, Transport
from asyncrl.engines.updates import StagedDirectory, WeightUpdate
from asyncrl.engines.weights import ParamSpec, StagedWeights, check_specs, read_manifest, validate_and_stage
from asyncrl.errors import WeightUpdateError

__all__ = ["FileTransport", "stage_as_files"]


class FileTransport(Transport):
    """Stage as files, reload under the pause. ``reload(path)`` makes the engine's workers load a directory;
    an exception of a type in ``fatal`` means the engine itself is gone, and is passed on without a restore."""

    kind = "files"
    accepts = FULL_ONLY
    direct_while_asleep = False  # see vllm_local.sleep.SleepTransport

    def __init__(self, engine: str, reload: Callable[[Path], Awaitable[None]], model_dir: str | Path,
                 dtype: torch.dtype, *, root: Path | None = None,
                 fatal: tuple[type[BaseException], ...] = ()) -> None:
        self._engine = engine
        self._reload = reload
        self._manifest = read_manifest(model_dir)
        self._dtype = dtype
        self._root = root  # None: staging_root()
        self._fatal = fatal
        # The last weights fully loaded, restored after a failed reload (the checkpoint itself at first).
        self._good = StagedWeights(Path(model_dir), owned=False)

    @property
    def good(self) -> Path:
        """The directory of the last weights fully loaded."""
        return self._good.path

    async def stage(self, update: WeightUpdate) -> WeightUpdate:
        return await stage_as_files(update, self._manifest, self._dtype, self._root)

    async def load(self, update: WeightUpdate) -> None:
        staged: StagedWeights = _prepared(self._engine, update)
        try:
            await self._reload(staged.path)
        except self._fatal:
            raise
        except Exception as exc:
            await restore_good_weights(self._engine, self._reload, self._good.path, exc)
            raise WeightUpdateError(f"engine {self._engine}: weight reload failed ({exc!r}); previous weights "
                                    f"restored, version stays at the previous one") from exc
        previous, self._good = self._good, staged.acquire()
        previous.release()

    async def before_sleep(self) -> None:
        pass  # nothing outside vLLM's memory pool

    async def reload_last(self) -> None:
        """Load the last good weights again (into weights a deep sleep discarded)."""
        await self._reload(self._good.path)

    def release(self, update: WeightUpdate) -> None:
        if update.staged is not None:
            update.staged.release()

    async def close(self) -> None:
        self._good.release()


async def stage_as_files(update: WeightUpdate, manifest: Mapping[str, ParamSpec], dtype: torch.dtype,
                         root: Path | None) -> WeightUpdate:
    """``update`` (full weights) with ``staged`` set to a hold on safetensors files of its weights, checked
    against ``manifest``: written now (as ``dtype``, under ``root``) for tensors in memory, adopted for files
    already staged (headers only). The source becomes the files, for the next engine of a pool to adopt instead
    of writing its own."""
    source = update.source
    if source.files is None:
        staged = await validate_and_stage(source.tensors, manifest, dtype, root)
        return replace(update, source=StagedDirectory(staged), staged=staged)
    check_specs(source.file_specs, manifest)
    return replace(update, staged=source.files.acquire())


def _prepared(engine: str, update: WeightUpdate) -> StagedWeights:
    if update.staged is None:
        raise WeightUpdateError(f"engine {engine}: version {update.version} was not prepared")
    return update.staged
