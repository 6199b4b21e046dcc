"""Reading a rollout log back: whole steps only, in the order trained, each step as the latest run logged it.

A torn step (the last message of a file whose writer was killed mid-write) is discarded with a warning; a step
that a later segment logged again (a run resumed from a checkpoint) is taken from that segment
(``files`` module docstring).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from asyncrl.rollout_log.files import LogFile, log_files
from asyncrl.rollout_log.schema import SCHEMA, StepRecord, from_batch, header_of

log = logging.getLogger(__name__)


def read(directory: str | Path, *, start: int = 1) -> Iterator[StepRecord]:
    """Every whole step of the log in ``directory`` from step ``start`` on, in step order, as typed groups."""
    for file, cutoff in _live(directory):
        for batch, meta in _batches(file):
            record = from_batch(batch, meta)
            if record.step >= cutoff:
                break
            if record.step >= start:
                yield record


def read_table(directory: str | Path) -> pa.Table:
    """The log's whole steps as one table (one row per rollout; ``schema`` module docstring), for pandas."""
    batches = [batch for file, cutoff in _live(directory) for batch, _ in _batches(file)
               if batch.num_rows and batch.column("step")[0].as_py() < cutoff]
    return pa.Table.from_batches(batches, schema=SCHEMA)


def header(directory: str | Path) -> dict[str, Any]:
    """The run's header (``schema`` module docstring) from the newest readable file."""
    for file in reversed(log_files(directory)):
        try:
            with pa.OSFile(str(file.path), "rb") as f:
                return header_of(pa.ipc.open_stream(f).schema)
        except (pa.ArrowInvalid, OSError):
            continue
    raise FileNotFoundError(f"no readable rollout log file in {directory}")


def _live(directory: str | Path) -> list[tuple[LogFile, int]]:
    """Each file with the first step it may hold no longer: the first step of a later segment."""
    files = log_files(directory)
    out = []
    for i, file in enumerate(files):
        later = [f.first_step for f in files[i + 1:] if f.segment > file.segment]
        out.append((file, min(later, default=2**62)))
    return out


def _batches(file: LogFile) -> Iterator[tuple[pa.RecordBatch, Any]]:
    with pa.OSFile(str(file.path), "rb") as f:
        try:
            reader = pa.ipc.open_stream(f)
        except (pa.ArrowInvalid, OSError) as exc:  # killed before its schema was whole: it holds no step
            log.warning("rollout log: %s holds no whole step (%s)", file.path.name, exc)
            return
        header_of(reader.schema)
        while True:
            try:
                batch, meta = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError) as exc:
                log.warning("rollout log: discarded a torn step at the end of %s (%s)", file.path.name, exc)
                return
            yield batch, meta
