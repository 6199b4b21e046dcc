"""Replay: a learner trained on exactly the batches a rollout log holds, in their order, from a checkpoint, with
no engine and no queue.

The optimiser step is the one the run took (``actors.training.LocalBackend``, the run's ``LearnerConfig`` from
the log's header: micro-batching, packing, precision, clipping), from the checkpoint's weights, optimiser state
and RNG states. With the loss the run used, the weights after step ``k`` equal the run's after step ``k``
bit for bit on a CPU (on a GPU, within its kernels' nondeterminism). With another loss or correction, the same
rollouts answer what that change would have done (a counterfactual); staleness-dependent terms see the versions
the run logged, since the groups carry them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from pydantic import TypeAdapter

from asyncrl.actors.training import LocalBackend
from asyncrl.algorithms.losses import GRPOLoss, Loss, LossConfig
from asyncrl.checkpoint.store import Checkpoint, restore, verify
from asyncrl.config import ConfigError, LearnerConfig, SamplingConfig
from asyncrl.recipes import default_optimizer
from asyncrl.rollout_log import header, read

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplayResult:
    """What a replay did."""

    model: torch.nn.Module  # the replayed weights
    start_step: int  # the checkpoint's step
    steps: int = 0  # steps replayed
    last_step: int = 0  # the step the weights are at now
    metrics: list[dict[str, float]] = field(default_factory=list)  # each replayed step's gauges


def follow_schedule(optimizer: torch.optim.Optimizer, logged: Mapping[str, float]) -> None:
    """Train at the learning rate the run's step had (its ``train/lr``): a schedule the run applied through a hook
    (the examples' warm-up and decay) is followed, not recomputed. The log records the first parameter group's
    rate, so an optimiser whose groups have different rates is refused."""
    lr = logged.get("train/lr")
    if lr is None:
        return
    rates = {g["lr"] for g in optimizer.param_groups}
    if len(rates) > 1:
        raise ValueError(f"the optimiser's parameter groups have different learning rates {sorted(rates)}; the "
                         f"log records one (train/lr): replay with an optimiser of one group")
    for group in optimizer.param_groups:
        group["lr"] = lr


def logged_learner(directory: str | Path) -> LearnerConfig:
    """The ``LearnerConfig`` the logged run trained with."""
    return TypeAdapter(LearnerConfig).validate_python(header(directory)["learner"])


def logged_loss_config(directory: str | Path) -> LossConfig:
    """The GRPO ``LossConfig`` the logged run trained with (``ConfigError`` if it used a loss of its own)."""
    return TypeAdapter(LossConfig).validate_python(_logged_grpo(directory)["config"])


def logged_loss(directory: str | Path, loss_config: LossConfig | None = None) -> GRPOLoss:
    """The run's GRPO loss, or the same loss with ``loss_config`` instead (a counterfactual)."""
    about = _logged_grpo(directory)
    config = loss_config or TypeAdapter(LossConfig).validate_python(about["config"])
    if config.kl_coef > 0:
        raise ConfigError("LossConfig.kl_coef", "a KL term needs its reference model: pass the loss to replay()")
    return GRPOLoss(config, sampling=TypeAdapter(SamplingConfig).validate_python(about["sampling"]),
                    pad_id=about["pad_id"])


def _logged_grpo(directory: str | Path) -> Mapping[str, Any]:
    about = header(directory)["loss"]
    if about is None:
        raise ConfigError("replay.loss", f"the run logged in {directory} trained a loss of its own: pass it")
    return about


def load_logged_model(directory: str | Path, model_dir: str | Path | None = None) -> torch.nn.Module:
    """The run's model architecture from ``model_dir`` (default: the one its header records), in its dtype; a
    replay restores the checkpoint's weights into it."""
    from transformers import AutoModelForCausalLM

    about = header(directory)
    path = model_dir or about.get("model_dir")
    if path is None:
        raise ConfigError("replay.model_dir", "the log records no model_dir (RolloutLogConfig.model_dir): pass one")
    dtype = getattr(torch, about["dtype"]) if about.get("dtype") else None
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)


def replay(directory: str | Path, checkpoint: Checkpoint | str | Path, *, model: torch.nn.Module,
           loss: Loss | None = None, loss_config: LossConfig | None = None, config: LearnerConfig | None = None,
           optimizer: Callable[[torch.nn.Module, LearnerConfig], torch.optim.Optimizer] = default_optimizer,
           until: int | None = None, metrics_out: TextIO | None = None) -> ReplayResult:
    """Train ``model`` (the run's architecture; its weights are the checkpoint's once restored) on the logged
    steps after ``checkpoint``'s, up to ``until`` (default: the log's last), and return it.

    ``loss`` defaults to the run's GRPO loss, with ``loss_config`` in place of its config if given; ``config`` to
    the run's ``LearnerConfig``; ``optimizer(model, config)`` builds the optimiser the checkpoint's state is loaded
    into (the recipe's AdamW by default). Each step's metrics, beside the ones the run logged, go to
    ``metrics_out`` as JSON lines. Raises ``ValueError`` when the log lacks a step after the checkpoint's."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else verify(checkpoint)
    config = config or logged_learner(directory)
    loss = loss or logged_loss(directory, loss_config)
    backend = LocalBackend(model, optimizer(model, config), loss, config)
    state = restore(ckpt, backend.model, backend.optimizer)
    result = ReplayResult(model=backend.model, start_step=state.step, last_step=state.step)
    for record in read(directory, start=state.step + 1):
        if until is not None and record.step > until:
            break
        if record.step != result.last_step + 1:
            raise ValueError(f"the rollout log in {directory} has no step {result.last_step + 1} (its next is "
                             f"{record.step}): it was rotated away (RolloutLogConfig.max_bytes) or never written")
        follow_schedule(backend.optimizer, record.metrics)
        metrics = backend.train_step(record.groups, record.step - 1)
        result.metrics.append(metrics)
        result.steps += 1
        result.last_step = record.step
        if metrics_out is not None:
            metrics_out.write(json.dumps({"step": record.step, "policy_version": record.policy_version,
                                          "metrics": metrics, "logged": dict(record.metrics)}) + "\n")
    if until is not None and result.last_step < until:
        raise ValueError(f"the rollout log in {directory} ends at step {result.last_step}, before step {until}")
    log.info("replayed steps %d..%d of %s from %s", state.step + 1, result.last_step, directory, ckpt.path)
    return result
