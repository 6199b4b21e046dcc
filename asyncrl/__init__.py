"""asyncrl: asyncio-native asynchronous RL for language models.

vLLM producers stream version-tagged rollouts into a bounded queue; an async learner trains on them and
publishes new weights into the engine (prepare -> pause -> load -> resume). A program needs this module and, for
a tiny model and task to try it on, ``asyncrl.testing``; the packages below it hold the rest by role.
"""

from typing import TYPE_CHECKING, Any

from asyncrl.actors import Evaluator, WeightSync, publish
from asyncrl.algorithms import GRPOLoss, LossConfig
from asyncrl.config import (
    AbortPolicy, Autocast, EpisodeConfig, InvalidGroupPolicy, LearnerConfig, PipelineConfig, ProducerConfig,
    QueueConfig, RewardExecution, RolloutLogConfig, SamplingConfig, SyncConfig,
)
from asyncrl.data import Example, PromptSource, encode_prompts
from asyncrl.episodes import EpisodeGroups
from asyncrl.errors import (
    ConfigError, DistributedError, EndOfRollouts, EngineError, InvalidGroupError, MemoryBudgetError, NoProgressError,
    PromptRejected, PublicationMismatch, QueueClosed, RolloutDropped, WeightUpdateError,
)
from asyncrl.groups import GroupMaker, GroupRequest, RewardFn, RewardGroups
from asyncrl.pipeline import Pipeline, RunResult
from asyncrl.recipes import grpo_pipeline
from asyncrl.runtime import Terminated, run
from asyncrl.types import (
    DropReason, FinishReason, PauseMode, Prompt, Rollout, RolloutGroup, Sample, SyncTiming, Trajectory, VersionSpan,
)
from asyncrl.versions import VersionClock

if TYPE_CHECKING:
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

__version__ = "0.2.0"

# vLLM in this process, imported on first use: ``import asyncrl`` stays cheap for a learner rank or a producer
# that talks to a server.
_ENGINE = {"VLLMEngine", "VLLMEngineConfig"}


def __getattr__(name: str) -> Any:
    if name in _ENGINE:
        from asyncrl.engines import vllm_local

        return getattr(vllm_local, name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")


__all__ = [
    "AbortPolicy", "Autocast", "ConfigError", "DistributedError", "DropReason", "EndOfRollouts", "EngineError",
    "EpisodeConfig", "EpisodeGroups", "Evaluator", "Example", "FinishReason", "GRPOLoss", "GroupMaker", "GroupRequest",
    "InvalidGroupError", "InvalidGroupPolicy", "LearnerConfig", "LossConfig", "MemoryBudgetError", "NoProgressError",
    "PauseMode",
    "Pipeline", "PipelineConfig", "ProducerConfig", "Prompt", "PromptRejected", "PromptSource", "PublicationMismatch",
    "QueueClosed", "QueueConfig", "RewardExecution", "RewardFn", "RewardGroups", "Rollout", "RolloutDropped",
    "RolloutGroup", "RolloutLogConfig", "RunResult", "Sample", "SamplingConfig", "SyncConfig", "SyncTiming",
    "Terminated", "Trajectory", "VLLMEngine", "VLLMEngineConfig", "VersionClock", "VersionSpan", "WeightSync",
    "WeightUpdateError",
    "encode_prompts", "grpo_pipeline", "publish", "run",
]
