"""The bounded rollout queue (a sending and a receiving end, with the staleness rule) and its HTTP form: a
``RolloutIngestServer`` in front of a sending end (learner side), and the ``RemoteQueueClient`` producers in other
processes post to."""

from asyncrl.queues.ingest_client import RemoteQueueClient, RemoteQueueClosed, RemoteQueueError
from asyncrl.queues.ingest_server import IngestServerConfig, RolloutIngestServer
from asyncrl.queues.rollout_queue import QueueStatistics, RolloutReceiver, RolloutSender, create_rollout_queue, is_fresh

__all__ = ["IngestServerConfig", "QueueStatistics", "RemoteQueueClient", "RemoteQueueClosed", "RemoteQueueError",
           "RolloutIngestServer", "RolloutReceiver", "RolloutSender", "create_rollout_queue", "is_fresh"]
