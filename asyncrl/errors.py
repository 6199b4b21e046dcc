"""Every error asyncrl raises on purpose, in one place. Each message names what was wrong."""

from __future__ import annotations

from asyncrl.types import DropReason


class ConfigError(ValueError):
    """A configuration value is invalid. ``field`` names it as ``Section.field``."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class MemoryBudgetError(ConfigError):
    """A batch holds a group that no forward/backward pass can fit within ``LearnerConfig.memory_budget_gib``,
    even with gradient checkpointing. Raised before the step's first forward: nothing was changed. Names the
    group, its forward tokens, what one pass over it needs and the budget (bytes)."""

    def __init__(self, group_id: str, tokens: int, needed_bytes: int, budget_bytes: int, message: str) -> None:
        super().__init__("LearnerConfig.memory_budget_gib", message)
        self.group_id = group_id
        self.tokens = tokens
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes


class EngineError(RuntimeError):
    """An engine failed or died. ``engine`` names which one."""

    def __init__(self, engine: str, message: str) -> None:
        super().__init__(f"engine {engine}: {message}")
        self.engine = engine


class PromptRejected(ValueError):
    """The engine refused a prompt; the group is dropped and counted. ``too_long``: it left no room in the
    engine's context (or was empty); otherwise the engine refused it for a reason of its own."""

    def __init__(self, message: str, *, too_long: bool = True) -> None:
        super().__init__(message)
        self.too_long = too_long


class RolloutDropped(Exception):
    """A group cannot be trained on. Raised while a group is being made (by an episode's environment or its
    runner, a tool call, the reward scorer); the producer catches it, drops the group and counts it under
    ``reason``."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class WeightUpdateError(RuntimeError):
    """A weight update was refused or failed. The engine kept (or was restored to) its previous weights and
    its version did not change."""


class PublicationMismatch(RuntimeError):
    """After a publication landed, the target scores a sequence otherwise than the weights the learner published:
    it serves other weights than its version says (``SyncConfig.probe_tolerance``). The run stops."""


class DistributedError(RuntimeError):
    """A learner rank failed, left, or stopped answering; the message names the rank and what it was doing."""


class QueueClosed(Exception):
    """The rollout queue's receiving end was closed: no more groups are accepted."""


class EndOfRollouts(Exception):
    """Every sending end of the rollout queue was closed and the queue is drained: no more groups will come."""


class InvalidGroupError(RuntimeError):
    """A group was invalid and the producer is configured to fail fast (``InvalidGroupPolicy.FAIL``)."""


class NoProgressError(RuntimeError):
    """The run cannot make progress (nothing trainable arrives, the data ran out, a reward hangs); the message
    says why, with the counts behind it."""
