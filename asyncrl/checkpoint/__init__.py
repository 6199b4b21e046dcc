"""Checkpoints: the store (``store``: format, write, verify, restore) and resuming a pipeline (``resume``)."""

from asyncrl.checkpoint.resume import checkpoint_hook, resume_pipeline, save_learner, training_state
from asyncrl.checkpoint.store import (
    Checkpoint, CheckpointConfig, Checkpointer, CorruptCheckpoint, ResumeState, TrainingState, latest, restore,
    verify,
)

__all__ = ["Checkpoint", "CheckpointConfig", "Checkpointer", "CorruptCheckpoint", "ResumeState", "TrainingState",
           "checkpoint_hook", "latest", "restore", "resume_pipeline", "save_learner", "training_state", "verify"]
