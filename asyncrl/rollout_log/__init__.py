"""The rollout log: every batch the learner trained, in order, on disk (Arrow IPC), for replay and inspection.

``RolloutLog`` writes it (the learner's recorder; ``PipelineConfig.rollout_log`` turns it on), ``read`` yields its
steps as typed groups, ``read_table`` gives it as one table. The format is the ``schema`` module's docstring.
Needs pyarrow (the ``replay`` extra)."""

from asyncrl.rollout_log.files import LogFiles, RolloutLogError, log_files
from asyncrl.rollout_log.reader import header, read, read_table
from asyncrl.rollout_log.schema import SCHEMA, StepRecord
from asyncrl.rollout_log.writer import RolloutLog, run_header

__all__ = ["SCHEMA", "LogFiles", "RolloutLog", "RolloutLogError", "StepRecord", "header", "log_files", "read",
           "read_table", "run_header"]
