"""Shared by the loss tests (not fixtures): ``t``, a float32 tensor written as nested lists."""

from __future__ import annotations

import torch


def t(rows: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32, requires_grad=grad)
