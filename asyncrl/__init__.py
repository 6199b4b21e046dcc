"""asyncrl: asyncio-native asynchronous RL for language models.

vLLM producers stream version-tagged rollouts into a bounded queue; an async learner trains on them and
publishes new weights into the engine (prepare -> pause -> load -> resume).
"""

from asyncrl.actors import Learner, Producer, RewardFn, WeightSync
from asyncrl.config import (
    AbortPolicy, Autocast, EpisodeConfig, InvalidGroupPolicy, LearnerConfig, PipelineConfig, ProducerConfig,
    QueueConfig, RewardExecution, SamplingConfig, SyncConfig,
)
from asyncrl.counters import GroupCounters
from asyncrl.data import PromptSource
from asyncrl.errors import (
    ConfigError, DistributedError, EndOfRollouts, EngineError, InvalidGroupError, NoProgressError, PromptRejected,
    QueueClosed, RolloutDropped, WeightUpdateError,
)
from asyncrl.episodes import Env, EnvFactory, Episode, StepResult, ToolBox, ToolCall, ToolEnv
from asyncrl.pipeline import Pipeline, RunResult
from asyncrl.queues import RolloutReceiver, RolloutSender, create_rollout_queue
from asyncrl.recipes import grpo_pipeline
from asyncrl.runtime import run
from asyncrl.types import (
    DropReason, FinishReason, PauseMode, Prompt, Rollout, RolloutGroup, Sample, SyncTiming, Trajectory, VersionSpan,
)
from asyncrl.versions import VersionClock

__version__ = "0.2.0"

__all__ = [
    "AbortPolicy", "Autocast", "ConfigError", "DistributedError", "DropReason", "EndOfRollouts", "EngineError", "Env",
    "EnvFactory", "Episode", "EpisodeConfig", "FinishReason", "GroupCounters",
    "InvalidGroupError", "InvalidGroupPolicy", "Learner", "LearnerConfig", "NoProgressError", "PauseMode",
    "Pipeline", "PipelineConfig", "Producer", "ProducerConfig", "Prompt", "PromptRejected", "PromptSource",
    "QueueClosed", "QueueConfig", "RewardExecution", "RewardFn", "Rollout", "RolloutDropped", "RolloutGroup",
    "RolloutReceiver", "RolloutSender", "RunResult", "Sample", "SamplingConfig", "StepResult", "SyncConfig",
    "SyncTiming", "ToolBox", "ToolCall", "ToolEnv", "Trajectory", "VersionClock",
    "VersionSpan", "WeightSync", "WeightUpdateError", "grpo_pipeline", "create_rollout_queue", "run",
]
