"""The learner's own speed: packed rows score like padded ones and keep sequences apart, gradient checkpointing
keeps the step, and token-sized micro-batches keep the step and the ranks in step."""

from __future__ import annotations

import pytest
import torch

from asyncrl.actors.training import LocalBackend, chunks, forward_tokens
from asyncrl.algorithms import GRPOLoss, LossConfig, ScoringOptions, completion_logprobs
from asyncrl.algorithms.rows import pack, packed_rows
from asyncrl.config import ConfigError, LearnerConfig
from asyncrl.distributed.partition import plan_batch
from tests.support.algorithms import BATCH, COMPLETIONS, PROMPTS, _assert_same_step, _group, _model, _step


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _model()


def _sequence_sharing_a_row(rows) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Two sequences packed into the same row: (earlier, later)."""
    for row in rows.row_of.unique():
        members = [i for i in range(len(rows.row_of)) if rows.row_of[i] == row]
        if len(members) > 1:
            return tuple(sorted(members, key=lambda i: int(rows.score_at[i, 0])))[:2]  # type: ignore[return-value]
    raise AssertionError("nothing was packed together")


# -------------------------------------------------------------------------------------------- the layout


def test_pack_fills_rows_first_fit_and_never_overflows() -> None:
    lengths = [8, 3, 4, 3, 5, 2]
    placement = pack(lengths, 8)
    rows: dict[int, list[tuple[int, int]]] = {}
    for (row, offset), n in zip(placement, lengths):
        rows.setdefault(row, []).append((offset, n))
    assert len(rows) == 4  # 8 | 5+3 | 4+3 | 2 (first fit, longest first)
    for spans in rows.values():
        spans.sort()
        assert spans[0][0] == 0 and sum(n for _, n in spans) <= 8
        assert all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))  # back to back
    assert pack([9, 2], 4) == [(0, 0), (1, 0)]  # too long for a row: a row of its own


def test_packed_positions_restart_per_sequence() -> None:
    rows = packed_rows(PROMPTS, COMPLETIONS, 0, torch.device("cpu"))
    assert rows.attention_mask is None and rows.input_ids.shape == (4, 8)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS)):
        start = int(rows.score_at[i, 0]) - len(p) + 1
        row = int(rows.row_of[i])
        assert rows.input_ids[row, start: start + len(p) + len(c)].tolist() == p + c
        assert rows.position_ids[row, start: start + len(p) + len(c)].tolist() == list(range(len(p) + len(c)))


# ----------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_scoring_equals_padded(attn: str) -> None:
    model = _model(attn)
    masks = [None, None, None, [0, 1], None, None]  # a multi-turn row (environment token first)
    with torch.no_grad():
        for temperature in (1.0, 0.7):
            kw = dict(temperature=temperature, with_entropy=True, loss_masks=masks)
            padded = completion_logprobs(model, PROMPTS, COMPLETIONS, packed=False, **kw)
            packed = completion_logprobs(model, PROMPTS, COMPLETIONS, packed=True, **kw)
            torch.testing.assert_close(packed.mask, padded.mask, atol=0, rtol=0)
            torch.testing.assert_close(packed.logprobs, padded.logprobs, atol=1e-5, rtol=0)
            torch.testing.assert_close(packed.entropy, padded.entropy, atol=1e-5, rtol=0)


def test_packed_rows_do_not_attend_across_sequences(model: torch.nn.Module) -> None:
    rows = packed_rows(PROMPTS, COMPLETIONS, 0, torch.device("cpu"))
    first, second = _sequence_sharing_a_row(rows)
    changed = [list(p) for p in PROMPTS]
    changed[first] = [(t + 7) % 50 for t in changed[first]]  # a different earlier neighbour in the same row

    def logprobs(prompts: list[list[int]], **kw: object) -> torch.Tensor:
        return completion_logprobs(model, prompts, COMPLETIONS, packed=True, **kw).logprobs  # type: ignore[arg-type]

    with torch.no_grad():
        base, moved = logprobs(PROMPTS), logprobs(changed)
    assert not torch.allclose(base[first], moved[first])  # the perturbation is real
    torch.testing.assert_close(moved[second], base[second], atol=0, rtol=0)  # ...and invisible next door
    # The control: the same packed row with a KV cache (transformers then skips packed detection) leaks,
    # which is why packed calls pass use_cache=False.
    with torch.no_grad():
        leak = [_with_cache(model, p)[second] for p in (PROMPTS, changed)]
    assert not torch.allclose(leak[0], leak[1])


def _with_cache(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    rows = packed_rows(prompts, COMPLETIONS, 0, torch.device("cpu"))
    logits = model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=True).logits
    scored = torch.log_softmax(logits[rows.row_of[:, None], rows.score_at].float(), dim=-1)
    return scored.gather(-1, rows.targets[..., None]).squeeze(-1) * rows.mask


def test_scoring_options_switch_the_default(model: torch.nn.Module) -> None:
    seen: list[bool] = []
    hook = model.get_decoder().register_forward_pre_hook(lambda _m, _a, kw: seen.append("attention_mask" in kw),
                                                         with_kwargs=True)
    try:
        with torch.no_grad():
            completion_logprobs(model, PROMPTS, COMPLETIONS)
            packing = ScoringOptions(packed=True)  # as the learner passes it with LearnerConfig.packing
            completion_logprobs(model, PROMPTS, COMPLETIONS, scoring=packing)
            completion_logprobs(model, PROMPTS, COMPLETIONS, packed=False, scoring=packing)  # explicit wins
            completion_logprobs(model, PROMPTS, COMPLETIONS)
    finally:
        hook.remove()
    assert seen == [True, False, True, True]


# ------------------------------------------------------------------------------------------ learner steps


def test_packed_learner_step_equals_padded(model: torch.nn.Module) -> None:
    padded = _step(model, LearnerConfig(micro_batch_rollouts=5))
    seen: list[bool] = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw.get("attention_mask") is None), with_kwargs=True)
    try:
        packed = _step(model, LearnerConfig(micro_batch_rollouts=5, packing=True))
    finally:
        hook.remove()
    assert seen and all(seen)  # the deep copy kept the hook: every pass ran packed
    _assert_same_step(packed, padded, atol=1e-5)
    assert not all(torch.equal(p, q) for p, q in zip(packed[0].parameters(), model.parameters()))  # it stepped


def test_gradient_checkpointing_recomputes_and_keeps_the_step(model: torch.nn.Module) -> None:
    attention = model.model.layers[0].self_attn  # inside the checkpointed block: runs again in the backward
    runs = [0]
    hook = attention.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
    try:
        plain = _step(model, LearnerConfig(micro_batch_rollouts=64))
        plain_runs, runs[0] = runs[0], 0
        ckpt = _step(model, LearnerConfig(micro_batch_rollouts=64, gradient_checkpointing=True))
    finally:
        hook.remove()
    assert plain[2] == ckpt[2] == 1 and plain_runs == 1
    assert runs[0] == 2 and ckpt[0].is_gradient_checkpointing  # forward + recomputation in the backward
    _assert_same_step(ckpt, plain)
    with pytest.raises(ConfigError, match="LearnerConfig.gradient_checkpointing"):
        lin = torch.nn.Linear(2, 2)
        LocalBackend(lin, torch.optim.SGD(lin.parameters(), lr=0.1), GRPOLoss(LossConfig()),
                     LearnerConfig(gradient_checkpointing=True))


# ------------------------------------------------------------------------------ token-sized micro-batches


def test_token_chunks_keep_groups_whole_and_under_the_budget() -> None:
    sizes = {g.group_id: forward_tokens(g) for g in BATCH}
    assert sizes == {"a": 9 + 15, "b": 12 + 4, "c": 8 + 21, "d": 8 + 4}
    parts = chunks(BATCH, max_rollouts=1, max_tokens=40)  # the rollout count no longer applies
    assert [[g.group_id for g in part] for part in parts] == [["a", "b"], ["c"], ["d"]]
    assert chunks(BATCH, 1, max_tokens=10) == [[g] for g in BATCH]  # each over the budget: alone
    assert chunks(BATCH, 1, max_tokens=1000) == [BATCH]


@pytest.mark.parametrize("packing", [False, True])
def test_token_micro_batches_give_the_unchunked_step(model: torch.nn.Module, packing: bool) -> None:
    whole = _step(model, LearnerConfig(micro_batch_rollouts=64, packing=packing))
    split = _step(model, LearnerConfig(micro_batch_tokens=30, packing=packing))
    assert whole[2] == 1 and split[2] == 4  # 24 | 16 | 29 | 12 tokens: one group each
    _assert_same_step(split, whole, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_with_a_token_budget_gives_every_rank_the_same_number_of_micro_batches(world: int) -> None:
    batch = [*BATCH, _group("e", 2, [1, 1, 1]), _group("inert", 3, [4, 4])]
    plan = plan_batch(batch, world, 64, 0, inert=lambda g: g.group_id == "inert", max_tokens=30)
    assert len({len(s.chunks) for s in plan.shards}) == 1 and len(plan.shards) == world
    real = [c for s in plan.shards for c in s.chunks if c.real]
    assert sorted(g.group_id for c in real for g in c.groups) == ["a", "b", "c", "d", "e"]
    assert all(len(c.groups) == 1 or sum(forward_tokens(g) for g in c.groups) <= 30 for c in real)
    if world == 1:
        assert len(real) == 4  # a | b | c | d+e (12 + 9): the budget, not the rollout count, cut them


@pytest.mark.parametrize("kwargs, field", [
    ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
    ({"micro_batch_tokens": 2.5}, "micro_batch_tokens"),
    ({"micro_batch_tokens": True}, "micro_batch_tokens"),
    ({"packing": "yes"}, "packing"),
    ({"gradient_checkpointing": 1}, "gradient_checkpointing"),
    ({"compile_layers": True, "compile_elementwise": True}, "compile_layers"),
])
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        LearnerConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == f"LearnerConfig.{field}"


def _reference_layout(prompts, completions, pad_id, placement, loss_masks):  # type: ignore[no-untyped-def]
    """The layout written one sequence at a time, straight from the ``Rows`` field comments."""
    n, rows = len(prompts), 1 + max(r for r, _ in placement)
    width = max(a + len(p) + len(c) for (_, a), p, c in zip(placement, prompts, completions))
    steps = max(len(c) for c in completions)
    ids, pos = torch.full((rows, width), pad_id), torch.zeros((rows, width), dtype=torch.long)
    attn = torch.zeros((rows, width), dtype=torch.long)
    score_at, targets = torch.zeros((n, steps), dtype=torch.long), torch.full((n, steps), pad_id)
    mask = torch.zeros((n, steps))
    last = {}
    for i, ((row, a), p, c) in enumerate(zip(placement, prompts, completions)):
        size = len(p) + len(c)
        ids[row, a:a + size] = torch.tensor([*p, *c])
        attn[row, a:a + size] = 1
        pos[row, a:a + size] = torch.arange(size)
        last[row] = max(last.get(row, (0, 0)), (a + size, size))
        score_at[i, :len(c)] = torch.arange(a + len(p) - 1, a + len(p) - 1 + len(c))
        targets[i, :len(c)] = torch.tensor(c)
        mask[i, :len(c)] = torch.tensor(loss_masks[i] if loss_masks and loss_masks[i] is not None else [1] * len(c))
    for row, (end, at_end) in last.items():
        pos[row, end:] = torch.arange(at_end, at_end + width - end)
    return ids, attn, pos, score_at, targets, mask


@pytest.mark.parametrize("seed", range(6))
def test_rows_match_a_sequence_at_a_time_layout(seed: int) -> None:
    import random

    from asyncrl.algorithms.rows import padded_rows

    rng = random.Random(seed)
    n = rng.randint(1, 12)
    prompts = [[rng.randrange(1, 99) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    completions = [[rng.randrange(1, 99) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    masks = [None if rng.random() < 0.5 else [rng.randint(0, 1) for _ in c] for c in completions] \
        if seed % 2 else None
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    for layout, placement, packed in ((padded_rows(prompts, completions, 0, torch.device("cpu"), masks),
                                       [(i, 0) for i in range(n)], False),
                                      (packed_rows(prompts, completions, 0, torch.device("cpu"), masks, row_tokens=12),
                                       pack(lengths, min(12, sum(lengths))), True)):
        ids, attn, pos, score_at, targets, mask = _reference_layout(prompts, completions, 0, placement, masks)
        assert torch.equal(layout.input_ids, ids) and torch.equal(layout.position_ids, pos)
        assert layout.attention_mask is None if packed else torch.equal(layout.attention_mask, attn)
        assert torch.equal(layout.row_of, torch.tensor([r for r, _ in placement]))
        assert torch.equal(layout.score_at, score_at) and torch.equal(layout.targets, targets)
        assert layout.mask.dtype == torch.float32 and torch.equal(layout.mask, mask)
        assert torch.equal(layout.scored, mask.flatten().nonzero().squeeze(1))
        flat_at = (layout.row_of[:, None] * ids.shape[1] + score_at).flatten()
        assert torch.equal(layout.hidden_at, flat_at[layout.scored])
