"""Shared by the checkpoint tests (not fixtures): the training script they run, also loaded here as a module
for its loss, data and digest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "train_with_checkpoints.py"
_spec = importlib.util.spec_from_file_location("train_with_checkpoints", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)
