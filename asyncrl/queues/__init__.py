"""The bounded rollout queue (with the staleness rule) and its remote form over HTTP."""

from asyncrl.queues.rollout_queue import QueueClosed, RolloutQueue, is_fresh

__all__ = ["QueueClosed", "RolloutQueue", "is_fresh"]
