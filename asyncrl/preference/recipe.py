"""Ready-made wiring of the preference trainers: Online DPO, XPO and Nash-MD on the same pipeline as GRPO.

The trainer decides the loss and what each group's completions are judged against:

==========  =====================================  ============================================================
trainer     judged against                         opponent (``opponent=``)
==========  =====================================  ============================================================
``dpo``     each other (best against worst of n)   none
``xpo``     one reference completion each          a sampler serving the frozen reference: a second engine
                                                   started from the base weights, never published to, or a
                                                   LoRA engine's base (``VLLMEngine.base_sampler()``)
``nash_md`` one mixture completion each            a ``MixtureSampler`` (torch, this process: vLLM cannot mix
                                                   two models' logits), refreshed after every learner step
==========  =====================================  ============================================================

Everything else is ``grpo_pipeline``'s: the queue, staleness, weight sync, metrics, checkpoints, ``run()``.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterable, Iterable

import torch

from asyncrl.algorithms.reference import Reference
from asyncrl.config import ConfigError, PipelineConfig
from asyncrl.data import PromptSource
from asyncrl.engines.protocols import Engine, Sampler
from asyncrl.metrics import Monitor
from asyncrl.pipeline import Pipeline
from asyncrl.preference.judges import JudgeFn
from asyncrl.preference.losses import NashMDLoss, OnlineDPOLoss, PreferenceConfig, XPOLoss
from asyncrl.preference.mixture import MixtureSampler
from asyncrl.preference.groups import JudgedGroups
from asyncrl.recipes import grpo_pipeline
from asyncrl.types import Prompt

__all__ = ["Trainer", "preference_pipeline"]


class Trainer(str, enum.Enum):
    DPO = "dpo"
    XPO = "xpo"
    NASH_MD = "nash_md"


LOSSES = {Trainer.DPO: OnlineDPOLoss, Trainer.XPO: XPOLoss, Trainer.NASH_MD: NashMDLoss}


def preference_pipeline(engine: Engine, model: torch.nn.Module, prompts: Iterable[Prompt] | AsyncIterable[Prompt] |
                        PromptSource, judge: JudgeFn, config: PipelineConfig | None = None, *,
                        trainer: Trainer | str = Trainer.DPO, preference: PreferenceConfig | None = None,
                        ref_model: Reference, opponent: Sampler | None = None, pad_id: int = 0,
                        optimizer: torch.optim.Optimizer | None = None, monitor: Monitor | None = None,
                        step: int = 0, close_engine: bool = True) -> Pipeline:
    """A ``Pipeline`` training ``model`` with ``trainer``'s preference loss on groups ``judge`` scored.

    ``ref_model``: the frozen reference the loss scores (a frozen copy, or ``asyncrl.lora.LoraReference()`` for
    a LoRA policy). ``opponent``: what XPO and Nash-MD judge against (module docstring); refused for DPO."""
    trainer = Trainer(trainer)
    config = config or PipelineConfig()
    _check_opponent(trainer, opponent)
    loss = LOSSES[trainer](preference or PreferenceConfig(), ref_model, sampling=config.producer.sampling,
                           pad_id=pad_id)
    groups = JudgedGroups(judge, opponent=opponent, keep_opponents=trainer is Trainer.XPO)
    pipe = grpo_pipeline(engine, model, prompts, groups, config, loss=loss, optimizer=optimizer, monitor=monitor,
                         step=step, close_engine=close_engine)
    if isinstance(opponent, MixtureSampler):  # declared by its type: the mixture follows the policy it mixes
        pipe.learner.hooks.append(opponent.follow(pipe.learner))
    return pipe


def _check_opponent(trainer: Trainer, opponent: Sampler | None) -> None:
    if trainer is Trainer.DPO and opponent is not None:
        raise ConfigError("preference_pipeline.opponent", "Online DPO judges a group's completions against each "
                                                          "other: it takes no opponent")
    if trainer is Trainer.XPO and (opponent is None or isinstance(opponent, MixtureSampler)):
        raise ConfigError("preference_pipeline.opponent", "XPO judges against the reference's completions: pass "
                                                          "a sampler serving the frozen reference (a second engine)")
    if trainer is Trainer.NASH_MD and not isinstance(opponent, MixtureSampler):
        raise ConfigError("preference_pipeline.opponent", "Nash-MD judges against the policy/reference mixture: "
                                                          "pass a MixtureSampler")
