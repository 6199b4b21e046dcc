"""A trainer written outside the package: its own group maker and its own loss, wired by ``grpo_pipeline`` and
evaluated by the library's ``Evaluator``, on the real engine, without a line of library code changed.

Best-of-n with a length penalty (rejection-sampling fine-tuning): each prompt's ``n`` completions are scored by
the task's reward minus a penalty per token, and the loss raises the likelihood of each group's best completion
alone. Only public names are used: ``asyncrl.GroupMaker``, ``GroupRequest``, ``asyncrl.groups``' sampling helpers,
``asyncrl.algorithms``' ``Loss`` and ``completion_logprobs``."""

from __future__ import annotations

import math

import pytest
import torch

import asyncrl
from asyncrl.algorithms import Loss, LossOutput, completion_logprobs
from asyncrl.groups import check_prompt, sample_completions
from asyncrl.testing.tasks import arithmetic
from tests.support import load_hf_model
from tests.support.pipelines import task_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

BEST = "best_of_n/best"  # the meta key where the maker marks each group's best rollout


class BestOfN(asyncrl.GroupMaker):
    """``n`` completions per prompt, each scored ``reward - penalty * tokens``; the best one marked in the
    group's meta. Its books: groups made and how often the best one was also a correct answer."""

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty
        self.groups = self.best_correct = 0

    async def make(self, request: asyncrl.GroupRequest) -> asyncrl.RolloutGroup:
        check_prompt(request)
        samples = await sample_completions(request)
        answer = request.prompt.answer
        scores = [arithmetic.reward(s.text, answer) - self.penalty * len(s.token_ids) for s in samples]
        best = max(range(len(samples)), key=scores.__getitem__)
        self.groups += 1
        self.best_correct += arithmetic.reward(samples[best].text, answer) == 1.0
        rollouts = tuple(asyncrl.Rollout(s, r) for s, r in zip(samples, scores))
        return asyncrl.RolloutGroup(request.group_id, request.prompt, rollouts, meta={BEST: best})

    def metrics(self) -> dict[str, float]:
        return {"best_of_n/groups": self.groups,
                "best_of_n/best_correct": self.best_correct / self.groups if self.groups else 0.0}

    def fork(self) -> BestOfN:
        return BestOfN(self.penalty)


class BestLikelihood(Loss):
    """Negative log-likelihood of each group's best completion, per token."""

    min_group_size = 2

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id
        self.groups_seen: list[str] = []

    def compute(self, model: torch.nn.Module, groups, **_: object) -> LossOutput:
        best = [g.rollouts[g.meta[BEST]].sample for g in groups]
        self.groups_seen += [g.group_id for g in groups]
        scored = completion_logprobs(model, [g.prompt.token_ids for g in groups], [s.token_ids for s in best],
                                     pad_id=self.pad_id)
        loss = -(scored.logprobs * scored.mask).sum() / max(scored.num_scored, 1)
        return LossOutput(loss=loss, metrics={"loss/best_nll": loss.detach()}, num_tokens=scored.num_scored)


async def test_a_trainer_defined_outside_the_package_trains_and_is_evaluated(vllm_engine, tiny_model_dir,
                                                                             tokenizer):
    maker = BestOfN(penalty=0.01)
    loss = BestLikelihood(tokenizer.pad_token_id)
    config = asyncrl.PipelineConfig(
        producer=asyncrl.ProducerConfig(sampling=asyncrl.SamplingConfig(n=4, max_tokens=6)),
        queue=asyncrl.QueueConfig(capacity=8, max_staleness=2),
        learner=asyncrl.LearnerConfig(batch_groups=4, lr=1e-3),
    )
    pipe = asyncrl.grpo_pipeline(vllm_engine, load_hf_model(tiny_model_dir), task_prompts(tokenizer, 64), maker,
                                 config, loss=loss, close_engine=False)
    _, held_out = arithmetic.split(0, 8)
    prompts = [asyncrl.Prompt(f"h{i}", tuple(tokenizer(p.prompt).input_ids), p.prompt, p.answer)
               for i, p in enumerate(held_out)]
    evaluator = asyncrl.Evaluator(vllm_engine, prompts, maker, every=2, config=config.producer)
    rows: list[dict[str, float]] = []
    pipe.learner.hooks += [evaluator, lambda step, metrics: rows.append(dict(metrics))]
    version = vllm_engine.version

    result = await pipe.run(steps=4)

    assert result.steps == 4 and result.unaccounted == 0 and vllm_engine.version == version + 4
    assert len(loss.groups_seen) == 16 and all(math.isfinite(r["loss/best_nll"]) for r in rows)
    # The maker's gauges reach every step once; the evaluation's are its own round's, from a fork.
    assert rows[-1]["best_of_n/groups"] >= 16 and "best_of_n/best_correct" in rows[-1]
    assert rows[1]["eval/samples"] == 8 and rows[1]["eval/best_of_n/groups"] == 8
    assert -1.0 <= rows[1]["eval/reward_mean"] <= 1.0
