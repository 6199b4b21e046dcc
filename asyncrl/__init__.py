"""asyncrl: asyncio-native asynchronous RL for language models.

vLLM producers stream version-tagged rollouts into a bounded queue; an async learner trains on them and
publishes new weights into the engine (prepare -> pause -> load -> resume).
"""

from asyncrl.actors import Evaluator, Learner, Producer, RewardFn, WeightSync, publish
from asyncrl.algorithms import GRPOLoss, LossConfig
from asyncrl.config import (
    AbortPolicy, Autocast, EpisodeConfig, InvalidGroupPolicy, LearnerConfig, PipelineConfig, ProducerConfig,
    QueueConfig, RewardExecution, SamplingConfig, SyncConfig,
)
from asyncrl.counters import GroupTotals
from asyncrl.data import PromptSource
from asyncrl.engines import state_dict_for_engine
from asyncrl.episodes import Env, EnvFactory, Episode, EpisodeRunner, StepResult, ToolBox, ToolCall, ToolEnv
from asyncrl.errors import (
    ConfigError, DistributedError, EndOfRollouts, EngineError, InvalidGroupError, NoProgressError, PromptRejected,
    PublicationMismatch, QueueClosed, RolloutDropped, WeightUpdateError,
)
from asyncrl.pipeline import Pipeline, RunResult
from asyncrl.queues import RemoteQueueClient, RolloutIngestServer, RolloutReceiver, RolloutSender, create_rollout_queue
from asyncrl.recipes import grpo_pipeline
from asyncrl.runtime import Terminated, run
from asyncrl.types import (
    DropReason, FinishReason, PauseMode, Prompt, Rollout, RolloutGroup, Sample, SyncTiming, Trajectory, VersionSpan,
)
from asyncrl.versions import VersionClock

__version__ = "0.2.0"

__all__ = [
    "AbortPolicy", "Autocast", "ConfigError", "DistributedError", "DropReason", "EndOfRollouts", "EngineError",
    "Env", "EnvFactory", "Episode", "EpisodeConfig", "EpisodeRunner", "Evaluator", "FinishReason", "GRPOLoss",
    "GroupTotals",
    "InvalidGroupError", "InvalidGroupPolicy", "Learner", "LearnerConfig", "LossConfig", "NoProgressError",
    "PauseMode", "Pipeline", "PipelineConfig", "Producer", "ProducerConfig", "Prompt", "PromptRejected",
    "PromptSource", "PublicationMismatch", "QueueClosed", "QueueConfig", "RemoteQueueClient", "RewardExecution",
    "RewardFn", "Rollout",
    "RolloutDropped", "RolloutGroup", "RolloutIngestServer", "RolloutReceiver", "RolloutSender", "RunResult",
    "Sample", "SamplingConfig", "StepResult", "SyncConfig", "SyncTiming", "Terminated", "ToolBox", "ToolCall",
    "ToolEnv",
    "Trajectory", "VersionClock", "VersionSpan", "WeightSync", "WeightUpdateError", "create_rollout_queue",
    "grpo_pipeline", "publish", "run", "state_dict_for_engine",
]
