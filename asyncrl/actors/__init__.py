"""Actors: producers (generate and score), the learner (train and publish), and weight sync."""

from asyncrl.actors.learner import Learner, StepResult
from asyncrl.actors.producer import InvalidGroupError, Producer, RewardFn
from asyncrl.actors.weight_sync import WeightSync

__all__ = ["InvalidGroupError", "Learner", "Producer", "RewardFn", "StepResult", "WeightSync"]
