"""Splitting one learner batch over the ranks of a data-parallel learner (pure functions).

Every rank must run the same number of forward/backward passes: each pass is a set of FSDP collectives, and
a rank that ran fewer would leave the others waiting in one. Ranks with less work run padding micro-batches
that count for nothing (``Chunk.real=False``). The token normaliser is the whole batch's, so the sum of every
rank's token-weighted micro-batch losses is the single-process loss of the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncrl.actors.training import Chunk, chunks
from asyncrl.types import RolloutGroup


@dataclass(frozen=True, slots=True)
class RankShard:
    """What one rank trains on in one step (sent to it by rank 0)."""

    step: int  # optimiser steps taken before this one (for messages)
    chunks: list[Chunk]  # this rank's micro-batches, padding included; the same count on every rank
    total_tokens: int  # completion tokens of the whole batch, inert groups included (the normaliser)
    active_groups: int  # groups scored over every rank (metrics are weighted over these)
    checkpointing: bool = False  # turn gradient checkpointing on first (the memory plan needs it; it stays on)


@dataclass(frozen=True, slots=True)
class BatchPlan:
    shards: list[RankShard]  # one per rank
    active_groups: int
    scored_rollouts: int  # rollouts in the active groups


Split = Callable[[Sequence[RolloutGroup]], list[list[RolloutGroup]]]


def plan_batch(batch: Sequence[RolloutGroup], world_size: int, max_rollouts: int, step: int,
               inert: Callable[[RolloutGroup], bool], *, max_tokens: int | None = None, split: Split | None = None,
               checkpointing: bool = False) -> BatchPlan:
    """Give each rank a share of the active groups balanced by tokens, cut into micro-batches of at most
    ``max_rollouts`` rollouts (or ``max_tokens`` forward tokens, as ``chunks``; or by ``split``, a memory plan's),
    and pad every rank to the same number of micro-batches. ``checkpointing`` goes to every shard."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total_tokens = sum(g.num_tokens for g in batch) or 1
    active = [g for g in batch if not inert(g)]
    parts = balanced(active, world_size)
    cut = split or (lambda groups: chunks(groups, max_rollouts, max_tokens))
    per_rank = [[Chunk(c) for c in cut(part)] if part else [] for part in parts]
    count = max(len(c) for c in per_rank)
    if active:
        filler = Chunk([min(active, key=lambda g: g.num_tokens)], real=False)  # the cheapest group
        per_rank = [c + [filler] * (count - len(c)) for c in per_rank]
    shards = [RankShard(step, c, total_tokens, len(active), checkpointing) for c in per_rank]
    return BatchPlan(shards, len(active), sum(len(g.rollouts) for g in active))


def balanced(groups: Sequence[RolloutGroup], parts: int) -> list[list[RolloutGroup]]:
    """``groups`` in ``parts`` lists of about equal token counts (largest first into the lightest list),
    each keeping the batch's order."""
    load = [0] * parts
    owner: dict[int, int] = {}
    for index in sorted(range(len(groups)), key=lambda i: -(groups[i].num_tokens + len(groups[i].rollouts))):
        rank = min(range(parts), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += groups[index].num_tokens + len(groups[index].rollouts)  # + rollouts: empty samples cost too
    out: list[list[RolloutGroup]] = [[] for _ in range(parts)]
    for index, group in enumerate(groups):
        out[owner[index]].append(group)
    return out
