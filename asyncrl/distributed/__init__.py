"""A learner across ranks: FSDP2 sharding (``fsdp``), the batch split over ranks (``partition``), publication
from the shards (``publication``), sharded checkpoints (``checkpoint``), and running it (``run``).

Needs only torch; launch with ``torchrun`` or ``asyncrl.launch.ray``. See docs/SCALING.md.
"""

from asyncrl.distributed.checkpoint import export_hf, load_sharded, read_meta, save_sharded
from asyncrl.distributed.fsdp import FSDPBackend, shard_model
from asyncrl.distributed.partition import BatchPlan, RankShard, plan_batch
from asyncrl.distributed.publication import full_buckets, stage_buckets
from asyncrl.distributed.ranks import DistributedError, RankConfig, RankContext, close_ranks, init_ranks
from asyncrl.distributed.run import run_ranks, sharded_pipeline

__all__ = ["BatchPlan", "DistributedError", "FSDPBackend", "RankConfig", "RankContext", "RankShard",
           "close_ranks", "export_hf", "full_buckets", "init_ranks", "load_sharded", "plan_batch",
           "read_meta", "run_ranks", "save_sharded", "shard_model", "sharded_pipeline", "stage_buckets"]
