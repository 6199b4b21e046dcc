"""asyncrl: asyncio-native asynchronous RL for language models.

vLLM producers stream version-tagged rollouts into a bounded queue; an async learner trains on them and
publishes new weights into the engine (pause -> update -> resume).
"""

from asyncrl.actors import Learner, Producer, WeightSync
from asyncrl.config import (
    AbortPolicy, ConfigError, InvalidGroupPolicy, LearnerConfig, PipelineConfig, ProducerConfig, QueueConfig,
    SamplingConfig, SyncConfig,
)
from asyncrl.data import PromptSource
from asyncrl.ledger import GroupLedger
from asyncrl.pipeline import Pipeline, RunStats
from asyncrl.queues import RolloutQueue
from asyncrl.runtime import run
from asyncrl.types import (
    DropReason, FinishReason, PauseMode, Prompt, Rollout, RolloutGroup, Sample, SyncTiming, VersionSpan,
)

__version__ = "0.1.0"

__all__ = [
    "AbortPolicy", "ConfigError", "DropReason", "FinishReason", "GroupLedger", "InvalidGroupPolicy", "Learner",
    "LearnerConfig", "PauseMode", "Pipeline", "PipelineConfig", "Producer", "ProducerConfig", "Prompt",
    "PromptSource", "QueueConfig", "Rollout", "RolloutGroup", "RolloutQueue", "RunStats", "Sample",
    "SamplingConfig", "SyncConfig", "SyncTiming", "VersionSpan", "WeightSync", "run",
]
