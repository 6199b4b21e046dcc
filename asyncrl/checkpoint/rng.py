"""The random number generator states a checkpoint carries (Python, torch, CUDA, NumPy), as JSON-safe values."""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
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


def set_rng_state(state: Mapping[str, Any]) -> None:
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


