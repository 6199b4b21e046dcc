"""Actors, the roles that run: producers (a group maker's groups into the queue), the learner (train and
publish), weight sync (``publish``: one publication into an engine driven by hand), and held-out evaluation as a
learner hook (``Evaluator``)."""

from asyncrl.actors.evaluation import Evaluator, greedy
from asyncrl.actors.learner import Learner, LearnerCounters, StepReport
from asyncrl.actors.producer import GroupSink, Producer, ProducerCounters
from asyncrl.actors.weight_sync import WeightSync, publish

__all__ = ["Evaluator", "GroupSink", "Learner", "LearnerCounters", "Producer", "ProducerCounters", "StepReport",
           "WeightSync", "greedy", "publish"]
