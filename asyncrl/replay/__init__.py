"""Replaying a logged run: the learner trained again on exactly the logged batches from a checkpoint (``replay``),
with the run's loss (bit-identical weights on a CPU) or another one (a counterfactual); the log read back as
typed groups (``read``) and drawn (``plot_log``). The log itself is ``asyncrl.rollout_log``; the command is
``asyncrl replay`` / ``asyncrl plot`` (``cli``)."""

from asyncrl.replay.learner import (
    ReplayResult, load_logged_model, logged_learner, logged_loss, logged_loss_config, replay,
)
from asyncrl.replay.plot import plot_log, step_summary
from asyncrl.rollout_log import StepRecord, header, read, read_table

__all__ = ["ReplayResult", "StepRecord", "header", "load_logged_model", "logged_learner", "logged_loss",
           "logged_loss_config", "plot_log", "read", "read_table", "replay", "step_summary"]
