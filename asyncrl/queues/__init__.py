"""The bounded rollout queue (a sending and a receiving end, with the staleness rule) and its HTTP form."""

from asyncrl.queues.rollout_queue import QueueStatistics, RolloutReceiver, RolloutSender, is_fresh, create_rollout_queue

__all__ = ["QueueStatistics", "RolloutReceiver", "RolloutSender", "is_fresh", "create_rollout_queue"]
