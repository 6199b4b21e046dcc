"""The ranks of a distributed learner: process groups from the launcher's environment, and the control channel
over which rank 0 tells the others what to do next.

Any launcher that sets the ``torch.distributed`` environment works: ``torchrun`` (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or ``asyncrl.launch.ray``. Collectives of the model (FSDP's
all-gathers and reduce-scatters) run on the default group: NCCL on GPUs, gloo on CPU. Commands travel on a
separate gloo group whose timeout covers rank 0 waiting for rollouts, so a follower can wait for the next
step as long as the learner may, and no longer.

Failure rule: a rank that fails exits its process. A peer's closed connection then fails the collective (or
command) any other rank is in at once; a silent peer fails it after the group's timeout. Either way every
rank raises ``DistributedError`` naming the rank and what it was doing, and the launcher (torchrun's agent,
or the Ray launcher) stops whatever is left.
"""

from __future__ import annotations

import datetime as dt
import gc
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import torch
import torch.distributed as dist
from pydantic import Field

from asyncrl.config_base import Seconds, config
from asyncrl.errors import DistributedError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RankContext:
    """This process's place among the learner's ranks."""

    rank: int
    world_size: int
    local_rank: int  # index of this rank on its host (its GPU, where there are GPUs)
    device: torch.device  # where the model's shard lives
    mesh: Any  # the 1-D DeviceMesh FSDP shards over
    control: Any  # gloo process group for rank 0's commands

    @property
    def leader(self) -> bool:
        """Rank 0 runs the pipeline; the others follow its commands."""
        return self.rank == 0


@config
class RankConfig:
    """How long the learner ranks wait for each other."""

    collective_timeout_s: Annotated[Seconds, Field(description="bounds every collective of the model")] = 300.0
    control_timeout_s: Annotated[Seconds, Field(description=(
        "bounds how long a follower waits for rank 0's next command (keep it above "
        "``LearnerConfig.stall_timeout_s``)"))] = 900.0


def init_ranks(config: RankConfig | None = None) -> RankContext:
    """Join the process group described by the environment (a world of 1 without a launcher), with the
    timeouts of ``config``."""
    config = config or RankConfig()
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=dt.timedelta(seconds=config.collective_timeout_s),
                                device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=config.control_timeout_s))
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    ctx = RankContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                      device=device, mesh=mesh, control=control)
    log.info("rank %d of %d on %s (%s)", ctx.rank, ctx.world_size, device, backend)
    return ctx


def close_ranks() -> None:
    """Leave the process group (after the last command). Idempotent.

    Destroying a group only shuts it down; its gloo worker threads live until the group is collected. Collect
    now, while the interpreter is whole: the control group carries the last command (the stop), and a gloo
    worker that lets go of that command's tensors during interpreter finalisation needs the GIL there and
    aborts the process ("terminate called without an active exception") after a run that succeeded. (torch's
    DTensor caches may keep the default group alive; its last collectives came before the stop.)"""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def guarded(ctx: RankContext, what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` (collectives); a failure of the process group becomes a ``DistributedError`` saying so."""
    try:
        return fn()
    except (RuntimeError, dist.DistBackendError) as exc:
        if isinstance(exc, DistributedError) or not _from_process_group(exc):
            raise
        raise DistributedError(f"rank {ctx.rank} of {ctx.world_size}: {what} failed: another rank failed, "
                               f"left or stopped answering ({exc})") from exc


def _from_process_group(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, dist.DistBackendError) or any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer", "socket"))


class ControlChannel:
    """Rank 0 -> every rank, one command at a time. Commands are serialised by a lock, so a stop sent from
    another thread waits for the step in progress instead of interleaving with its collectives."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.lock = threading.Lock()

    def scatter(self, per_rank: Sequence[object]) -> object:
        """Rank 0: hand ``per_rank[r]`` to rank ``r``; returns rank 0's own. Hold ``lock`` around the command
        and the work that follows it."""
        if len(per_rank) != self.ctx.world_size:
            raise ValueError(f"{len(per_rank)} commands for {self.ctx.world_size} ranks")
        out: list[Any] = [None]
        guarded(self.ctx, f"sending {type(per_rank[0]).__name__}", lambda: dist.scatter_object_list(
            out, list(per_rank), src=0, group=self.ctx.control))
        return out[0]

    def receive(self) -> object:
        """A follower: wait for rank 0's next command."""
        out: list[Any] = [None]
        guarded(self.ctx, "waiting for rank 0's next command",
                lambda: dist.scatter_object_list(out, None, src=0, group=self.ctx.control))
        return out[0]

    def all_sum(self, values: Sequence[float]) -> list[float]:
        """Sum a short vector of floats over ranks (metrics), on the control group."""
        t = torch.tensor(list(values), dtype=torch.float64)
        guarded(self.ctx, "summing metrics", lambda: dist.all_reduce(t, group=self.ctx.control))
        return t.tolist()
