"""The learner's memory plan (``asyncrl.actors.memory``, ``LearnerConfig.memory_budget_gib``) on real CPU steps of
tiny Qwen2 models: the measured peak of a step stays inside its budget and under the plan's prediction (which is
not absurdly high); a smaller budget splits long groups into more passes without changing the step; gradient
checkpointing goes on only when a group needs it; a group that fits no pass is refused before anything changes;
a budget below the static bytes is refused at construction; the field is validated."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from asyncrl.actors.memory import GIB, plan_memory
from asyncrl.actors.optimizer import StochasticAdamW
from asyncrl.actors.training import LocalBackend
from asyncrl.algorithms import GRPOLoss, LossConfig
from asyncrl.config import ConfigError, LearnerConfig
from asyncrl.distributed.partition import plan_batch
from asyncrl.errors import MemoryBudgetError
from tests.support.algorithms import _group

pytestmark = pytest.mark.timeout(120)

# Long groups (1,060 to 1,444 forward tokens) and a short one (58); rewards vary within each, so none is inert.
BATCH = [_group("a", 12, [300, 280, 420, 250]), _group("b", 20, [500, 90, 410]), _group("c", 8, [12, 30]),
         _group("d", 16, [350, 360, 340, 330])]


def qwen(hidden: int = 64, layers: int = 2, vocab: int = 256) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).train()


class Counting(GRPOLoss):
    """GRPO that counts its passes (one ``compute`` per micro-batch)."""

    def __init__(self) -> None:
        super().__init__(LossConfig())
        self.passes = 0

    def compute(self, model, groups, **kw):  # type: ignore[no-untyped-def]
        self.passes += 1
        return super().compute(model, groups, **kw)


def backend(model: torch.nn.Module, adam: bool = False, **kw: object) -> LocalBackend:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if adam else torch.optim.SGD(model.parameters(), lr=0.1)
    return LocalBackend(model, opt, Counting(), LearnerConfig(**kw))  # type: ignore[arg-type]


def peak_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """The most bytes the CPU allocator had handed out at once while ``fn`` ran, above what was allocated before:
    the running sum of the profiler's allocation events (frees negative), in time order."""
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    running = top = 0
    for _, size in sorted(events):
        running += size
        top = max(top, running)
    return top


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *model.buffers(),
               *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))]
    return sum(t.numel() * t.element_size() for t in tensors)


def needs(model: torch.nn.Module, groups: list, checkpointing: bool, **kw: object) -> int:  # type: ignore[type-arg]
    """What the plan predicts for one pass over ``groups``."""
    plan = plan_memory(model, torch.optim.SGD(model.parameters(), lr=0.1), LearnerConfig(memory_budget_gib=64.0, **kw))
    return plan.predicted_peak_bytes(plan.pass_of(groups), checkpointing)


@pytest.mark.parametrize("options", [{}, {"packing": True, "autocast": "bfloat16"}, {"score_from_logits": True}],
                         ids=["padded", "packed-autocast", "logits"])
def test_a_real_step_stays_inside_its_budget_and_under_the_prediction(options: dict) -> None:  # type: ignore[type-arg]
    model = qwen()
    whole = needs(model, BATCH, False, **options)
    budget = 0.45 * whole / GIB  # about half of one pass over the whole batch: it must be split
    learner = backend(model, adam=True, memory_budget_gib=budget, **options)
    learner.train_step(BATCH, 0)  # AdamW's states exist from here on
    learner.optimizer.zero_grad(set_to_none=True)
    before, metrics = held_bytes(model, learner.optimizer), {}
    learner.loss.passes = 0
    measured = before + peak_bytes(lambda: metrics.update(learner.train_step(BATCH, 1)))
    predicted = metrics["learner/memory_predicted_gib"] * GIB
    assert learner.loss.passes > 1 and "learner/memory_peak_gib" not in metrics  # no CUDA counter on a CPU
    assert measured <= budget * GIB, (measured, budget * GIB)
    assert measured <= predicted <= 3 * measured, (measured, predicted)


def step(model: torch.nn.Module, **kw: object) -> tuple[torch.nn.Module, dict[str, float], int, bool]:
    """One step on a copy of ``model``: the trained copy, its metrics, its passes, and whether it checkpointed."""
    trained = copy.deepcopy(model)
    learner = backend(trained, **kw)
    metrics = learner.train_step(BATCH, 0)
    return trained, metrics, learner.loss.passes, trained.is_gradient_checkpointing  # type: ignore[attr-defined]


def assert_same_step(a: tuple, b: tuple) -> None:  # type: ignore[type-arg]
    for key in ("loss/total", "train/grad_norm"):
        assert a[1][key] == pytest.approx(b[1][key], rel=1e-5, abs=1e-6), key
    for p, q in zip(a[0].parameters(), b[0].parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_a_smaller_budget_splits_long_groups_into_more_passes_and_the_step_is_the_same() -> None:
    model = qwen()
    largest = max(needs(model, [g], False) for g in BATCH)
    plain = step(model)
    roomy = step(model, memory_budget_gib=2 * needs(model, BATCH, False) / GIB)
    tight = step(model, memory_budget_gib=1.05 * largest / GIB)
    assert plain[2] == roomy[2] == 1 and tight[2] == len(BATCH)  # padded, even the short group goes alone
    assert not tight[3]  # each group fits without checkpointing
    assert "learner/memory_predicted_gib" not in plain[1]
    assert tight[1]["learner/memory_predicted_gib"] <= 1.05 * largest / GIB < roomy[1]["learner/memory_predicted_gib"]
    assert_same_step(plain, roomy)
    assert_same_step(plain, tight)
    capped = step(model, memory_budget_gib=2 * needs(model, BATCH, False) / GIB, micro_batch_tokens=2000)
    assert capped[2] == len(BATCH) - 1  # micro_batch_tokens caps the passes further
    assert_same_step(plain, capped)


def test_checkpointing_is_turned_on_only_when_a_group_needs_it() -> None:
    model = qwen()
    group = max(BATCH, key=lambda g: needs(model, [g], False))
    without, with_ = needs(model, [group], False), needs(model, [group], True)
    assert with_ < without
    plain = step(model)
    fits = step(model, memory_budget_gib=1.05 * without / GIB)
    squeezed = step(model, memory_budget_gib=(with_ + without) / 2 / GIB)
    assert not fits[3] and squeezed[3]
    assert squeezed[2] == len(BATCH)  # every pass as small as it gets
    assert_same_step(plain, squeezed)
    asked = step(model, memory_budget_gib=1.05 * without / GIB, gradient_checkpointing=True)
    assert asked[3]  # the config's own setting stays


def test_a_group_too_long_for_the_budget_is_refused_before_anything_changes() -> None:
    model = qwen()
    short, group = BATCH[2], BATCH[1]
    tokens = sum(len(group.prompt.token_ids) + len(r.sample.token_ids) for r in group.rollouts)
    budget = 0.9 * needs(model, [group], True) / GIB
    assert needs(model, [short], False) < budget * GIB  # the short group alone would fit
    learner = backend(model, adam=True, memory_budget_gib=budget)
    weights = copy.deepcopy(model.state_dict())
    with pytest.raises(MemoryBudgetError) as caught:
        learner.train_step([short, group], 0)
    message = str(caught.value)
    assert "'b'" in message and f"{tokens} forward tokens" in message and f"{budget:.4g} GiB" in message, message
    assert "even with gradient checkpointing" in message
    assert caught.value.field == "LearnerConfig.memory_budget_gib" and caught.value.tokens == tokens
    assert learner.loss.passes == 0 and not learner.optimizer.state  # no forward ran, the optimiser never stepped
    assert all(p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_a_budget_below_the_static_bytes_is_refused_at_construction() -> None:
    model = qwen()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    static = params * 4 + sum(b.numel() * b.element_size() for b in model.buffers())  # + grads, AdamW's two
    budget = 0.5 * static / GIB
    with pytest.raises(ConfigError, match="memory_budget_gib") as caught:
        backend(model, adam=True, memory_budget_gib=budget)
    assert f"{budget:.4g} GiB" in str(caught.value) and f"{static / GIB:.4g} GiB" in str(caught.value), caught.value


def test_stochastic_adamw_is_planned_with_bf16_states_and_one_chunk_of_float32_temporaries() -> None:
    model = qwen(hidden=128).bfloat16()
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    optimizer = StochasticAdamW(model.parameters(), lr=1e-5, chunk_elements=largest // 3)
    plan = plan_memory(model, optimizer, LearnerConfig(memory_budget_gib=1.0))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert plan.static_bytes == 4 * trainable + buffers  # bf16 weights, gradients, two states: 8 bytes a parameter
    assert plan.step_bytes == optimizer.temporary_bytes() < trainable  # not torch's trainable-sized copy
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # the states exist from here on
    counters = 4 * len(optimizer.state)  # a float32 step count per parameter, not planned
    assert held_bytes(model, optimizer) + trainable == plan.static_bytes + counters  # (+ the gradients)
    measured = peak_bytes(optimizer.step)
    assert 0.5 * plan.step_bytes <= measured <= plan.step_bytes, (measured, plan.step_bytes)


def test_a_model_without_a_transformers_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="memory_budget_gib.*transformers decoder"):
        backend(torch.nn.Linear(4, 4), memory_budget_gib=1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), True, "2"])
def test_the_budget_field_is_validated(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"LearnerConfig\.memory_budget_gib"):
        LearnerConfig(memory_budget_gib=bad)  # type: ignore[arg-type]
    assert LearnerConfig(memory_budget_gib=2).memory_budget_gib == 2.0
    assert LearnerConfig().memory_budget_gib is None


def test_the_sharded_learner_splits_each_rank_s_share_by_the_plan() -> None:
    model = qwen()
    tight = plan_memory(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        LearnerConfig(memory_budget_gib=1.05 * max(needs(model, [g], False) for g in BATCH) / GIB))
    tight = tight.for_batch(BATCH)
    plan = plan_batch(BATCH, 2, 64, 0, lambda g: False, split=tight.split, checkpointing=tight.checkpointing)
    assert {len(s.chunks) for s in plan.shards} == {2} and not any(s.checkpointing for s in plan.shards)
    real = [[g.group_id for g in c.groups] for s in plan.shards for c in s.chunks if c.real]
    assert sorted(g for c in real for g in c) == ["a", "b", "c", "d"]
    assert all(tight.fits([g for g in BATCH if g.group_id in ids]) for ids in real)
