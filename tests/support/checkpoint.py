"""Shared by the checkpoint tests (not fixtures): the training script they run, also loaded here as a module
for its loss, data and digest."""

from __future__ import annotations

from pathlib import Path

from tests.support.scripts import train_with_checkpoints as script

SCRIPT = Path(script.__file__)
