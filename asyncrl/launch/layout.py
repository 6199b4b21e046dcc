"""Where the servers and the learner ranks go: placement-group bundles, and the layouts that cannot work.

One bundle per vLLM server, then one per learner rank. Each bundle is a whole number of GPUs or none: Ray
hands whole GPUs to one bundle, so a rank's GPU never also holds a server and rank 0 can join vLLM's NCCL
weight-transfer group (NCCL does not put two ranks of one communicator on one device). Fractional GPUs would
let Ray pack a server beside a rank; they are refused.
"""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import Field, model_validator

from asyncrl.config_base import PositiveInt, config, require


class PlacementStrategy(str, enum.Enum):
    """Ray's placement strategies for the bundles of one placement group."""

    PACK = "PACK"  # fewest nodes
    SPREAD = "SPREAD"  # as many nodes as possible
    STRICT_PACK = "STRICT_PACK"  # one node, or fail
    STRICT_SPREAD = "STRICT_SPREAD"  # one node per bundle, or fail


GPUs = Annotated[int, Field(strict=True, ge=0)]  # whole GPUs: a fractional GPU could put a server beside a rank
CPUs = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]


@config
class Layout:
    """What to place. CPU-only by default (``*_gpus=0``)."""

    servers: Annotated[PositiveInt, Field(description="vLLM servers (each an ``EnginePool`` member)")] = 1
    ranks: Annotated[PositiveInt, Field(description="learner ranks (FSDP world size)")] = 2
    server_gpus: Annotated[GPUs, Field(description=(
        "GPUs per server (its tensor-parallel size on GPU); whole GPUs only"))] = 0
    rank_gpus: Annotated[GPUs, Field(le=1, description="GPUs per learner rank (0 or 1)")] = 0
    server_cpus: Annotated[CPUs, Field(description="CPUs reserved per server")] = 1.0
    rank_cpus: Annotated[CPUs, Field(description="CPUs reserved per rank")] = 1.0
    strategy: Annotated[PlacementStrategy, Field(description="Ray placement strategy")] = PlacementStrategy.PACK

    @model_validator(mode="after")
    def _rules(self) -> Layout:
        require((self.rank_gpus == 0) == (self.server_gpus == 0), self, "rank_gpus",
                "servers and ranks both on GPUs or both on CPUs")
        return self

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
