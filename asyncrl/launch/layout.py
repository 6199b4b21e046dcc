"""Where the servers and the learner ranks go: placement-group bundles, and the layouts that cannot work.

One bundle per vLLM server, then one per learner rank. Each bundle is a whole number of GPUs or none: Ray
hands whole GPUs to one bundle, so a rank's GPU never also holds a server and rank 0 can join vLLM's NCCL
weight-transfer group (NCCL does not put two ranks of one communicator on one device). Fractional GPUs would
let Ray pack a server beside a rank; they are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncrl.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Layout:
    """What to place. CPU-only by default (``*_gpus=0``)."""

    servers: int = 1  # vLLM servers (each an ``EnginePool`` member)
    ranks: int = 2  # learner ranks (FSDP world size)
    server_gpus: int = 0  # GPUs per server (its tensor-parallel size on GPU)
    rank_gpus: int = 0  # GPUs per learner rank (0 or 1)
    server_cpus: float = 1.0  # CPUs reserved per server
    rank_cpus: float = 1.0  # CPUs reserved per rank
    strategy: str = "PACK"  # Ray placement strategy: PACK (fewest nodes), SPREAD, STRICT_PACK, STRICT_SPREAD

    def __post_init__(self) -> None:
        for name in ("servers", "ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Layout.{name}", f"must be an integer >= 1, got {value!r}")
        for name in ("server_gpus", "rank_gpus"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"Layout.{name}", f"must be a whole number of GPUs >= 0 (a fractional GPU "
                                                    f"could put a server beside a rank), got {value!r}")
        if self.rank_gpus > 1:
            raise ConfigError("Layout.rank_gpus", f"one GPU per learner rank, got {self.rank_gpus}")
        if (self.rank_gpus == 0) != (self.server_gpus == 0):
            raise ConfigError("Layout.rank_gpus", "servers and ranks both on GPUs or both on CPUs")
        for name in ("server_cpus", "rank_cpus"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"Layout.{name}", f"must be > 0, got {value!r}")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ConfigError("Layout.strategy", f"not a Ray placement strategy: {self.strategy!r}")

    def bundles(self) -> list[dict[str, float]]:
        """Servers first (bundle ``i`` for server ``i``), then ranks (bundle ``servers + r`` for rank ``r``)."""
        def bundle(cpus: float, gpus: int) -> dict[str, float]:
            return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

        return ([bundle(self.server_cpus, self.server_gpus)] * self.servers
                + [bundle(self.rank_cpus, self.rank_gpus)] * self.ranks)

    def server_bundle(self, index: int) -> int:
        return index

    def rank_bundle(self, rank: int) -> int:
        return self.servers + rank

    @property
    def total_gpus(self) -> int:
        return self.servers * self.server_gpus + self.ranks * self.rank_gpus
