"""Actors: producers (generate and score), the learner (train and publish), and weight sync (``publish``: one
publication into an engine driven by hand)."""

from asyncrl.actors.learner import Learner, LearnerCounters, StepReport
from asyncrl.actors.producer import GroupSink, Producer, ProducerCounters
from asyncrl.actors.rewards import RewardFn
from asyncrl.actors.weight_sync import WeightSync, publish

__all__ = ["GroupSink", "Learner", "LearnerCounters", "Producer", "ProducerCounters", "RewardFn", "StepReport",
           "WeightSync", "publish"]
