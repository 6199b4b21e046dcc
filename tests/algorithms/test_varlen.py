"""Variable-length attention for packed rows, and compiled element-wise chains (MLP and RMSNorm modules, the
log-prob head's chunk maths): the same log-probs and the same learner step as padded sdpa in eager mode, with
each sequence kept to itself. On CPU the varlen kernel is the per-sequence reference;
tests/algorithms/test_gpu_varlen.py checks torch's flash kernel against it on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from asyncrl.actors.training import LocalBackend
from asyncrl.algorithms import GRPOLoss, LossConfig, completion_logprobs, varlen
from asyncrl.algorithms.head import chosen_logprobs
from asyncrl.algorithms.logprobs import width_multiple
from asyncrl.algorithms.rows import packed_rows
from asyncrl.config import ConfigError, LearnerConfig
from tests.support.algorithms import COMPLETIONS, PROMPTS, _assert_same_step, _model, _step


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _model()


@pytest.fixture()
def varlen_model(model: torch.nn.Module) -> torch.nn.Module:
    out = copy.deepcopy(model)
    varlen.install(out)
    return out


@pytest.fixture()
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Segment lengths of every varlen kernel call (the reference kernel still runs)."""
    calls: list[tuple[int, ...]] = []
    real = varlen.varlen_causal

    def counting(q, k, v, segments, scale):  # type: ignore[no-untyped-def]
        cu = segments.cu.tolist()
        calls.append(tuple(b - a for a, b in zip(cu, cu[1:])))
        return real(q, k, v, segments, scale)

    monkeypatch.setattr(varlen, "varlen_causal", counting)
    return calls


def test_segments_tile_the_packed_rows() -> None:
    lengths = [len(p) + len(c) for p, c in zip(PROMPTS, COMPLETIONS)]  # 8, 3, 4, 3, 5, 2
    one = packed_rows(PROMPTS, COMPLETIONS, 0, torch.device("cpu"), row_tokens=float("inf"))
    assert one.input_ids.shape == (1, 25) and sorted(one.segments) == sorted(lengths)
    rows = packed_rows(PROMPTS, COMPLETIONS, 0, torch.device("cpu"))  # 4 rows of 8: 8 | 5+3 | 4+3 (+1) | 2 (+6)
    assert rows.input_ids.shape == (4, 8) and rows.segments == (8, 5, 3, 4, 3, 1, 2, 6)
    # each run is a whole sequence (positions 0..n-1) or a row's tail padding (pad ids up to the row's end)
    positions, ids, at = rows.position_ids.flatten(), rows.input_ids.flatten(), 0
    for n in rows.segments:
        if int(positions[at]) == 0:
            assert positions[at:at + n].tolist() == list(range(n))
        else:
            assert (at + n) % 8 == 0 and not ids[at:at + n].any()
        at += n
    assert at == 32


@pytest.mark.parametrize("groups", [1, 2])
def test_reference_kernel_keeps_sequences_apart(groups: int) -> None:
    torch.manual_seed(0)
    lengths = [5, 1, 7]
    q = torch.randn(sum(lengths), 4, 8)
    k, v = torch.randn(sum(lengths), 4 // groups, 8), torch.randn(sum(lengths), 4 // groups, 8)
    out = varlen.varlen_causal(q, k, v, varlen.Segments.from_lengths(lengths, q.device), 0.3)
    at = 0
    for n in lengths:  # each sequence alone, as full causal sdpa sees it
        alone = F.scaled_dot_product_attention(*(t[at:at + n].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                               scale=0.3, enable_gqa=groups > 1).transpose(0, 1)
        torch.testing.assert_close(out[at:at + n], alone)
        at += n


@pytest.mark.parametrize("entropy", [False, True])
def test_varlen_scoring_equals_padded_sdpa(model, varlen_model, kernel_calls, entropy: bool) -> None:
    ref = completion_logprobs(model, PROMPTS, COMPLETIONS, packed=False, with_entropy=entropy)
    out = completion_logprobs(varlen_model, PROMPTS, COMPLETIONS, packed=True, with_entropy=entropy)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    if entropy:
        torch.testing.assert_close(out.entropy, ref.entropy, atol=1e-5, rtol=1e-5)
    # one row, one kernel call per layer, each over the six sequences
    assert len(kernel_calls) == model.config.num_hidden_layers
    assert all(sorted(c) == [2, 3, 3, 4, 5, 8] for c in kernel_calls)


def test_a_large_varlen_row_is_padded_to_a_recurring_width_and_scores_the_same(model, varlen_model,
                                                                              kernel_calls) -> None:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 50, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 30, (20,), generator=gen)]
    completions = [torch.randint(1, 50, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, 40, (20,), generator=gen)]
    total = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    multiple = width_multiple(total)
    assert multiple > 1 and total % multiple  # this batch does get padded
    ref = completion_logprobs(model, prompts, completions, packed=False)
    out = completion_logprobs(varlen_model, prompts, completions, packed=True)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    # the row's tail padding is a segment of its own, after the sequences
    runs = kernel_calls[0]
    assert len(kernel_calls) == model.config.num_hidden_layers and all(c == runs for c in kernel_calls)
    assert sum(runs) % multiple == 0 and runs[-1] == -total % multiple and sum(runs[:-1]) == total
    assert [width_multiple(t) for t in (64, 128, 43000, 65536)] == [1, 2, 512, 1024]


def test_a_varlen_model_still_honours_padding_masks_and_unannounced_packing(model, varlen_model,
                                                                            kernel_calls) -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding: the mask matters
    got = varlen_model(input_ids=ids, attention_mask=mask).logits
    want = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
    assert not kernel_calls  # masked calls go to sdpa
    rows = packed_rows(PROMPTS, COMPLETIONS, 0, torch.device("cpu"))  # restarting positions, no segments given
    got = varlen_model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False).logits
    want = model(input_ids=rows.input_ids, position_ids=rows.position_ids, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # split at the restarts and row starts; a row's tail padding continues the positions of the sequence before
    # it, so it joins that run, causally after every real token of it
    assert kernel_calls and all(c == (8, 5, 3, 4, 3 + 1, 2 + 6) for c in kernel_calls)


def test_varlen_learner_step_equals_padded(model, kernel_calls) -> None:
    padded = _step(model, LearnerConfig(micro_batch_rollouts=5))
    packed = _step(model, LearnerConfig(micro_batch_rollouts=5, packing=True, varlen_attention=True))
    assert packed[0].config._attn_implementation == varlen.VARLEN and kernel_calls
    _assert_same_step(packed, padded, atol=1e-5)


def test_compiled_elementwise_keeps_the_step(model) -> None:
    eager = _step(model, LearnerConfig(micro_batch_tokens=30, packing=True))
    compiled = _step(model, LearnerConfig(micro_batch_tokens=30, packing=True, compile_elementwise=True))
    layer = compiled[0].model.layers[0]
    assert layer.mlp._compiled_call_impl is not None and layer.input_layernorm._compiled_call_impl is not None
    _assert_same_step(compiled, eager, atol=1e-5)


@pytest.mark.parametrize("ckpt", [False, True])  # checkpointing recomputes each compiled layer in the backward
def test_compiled_layers_keep_the_step(model, ckpt: bool) -> None:
    eager = _step(model, LearnerConfig(micro_batch_tokens=30, packing=True, varlen_attention=True))
    compiled = _step(model, LearnerConfig(micro_batch_tokens=30, packing=True, varlen_attention=True,
                                          compile_layers=True, gradient_checkpointing=ckpt))
    decoder = compiled[0].model
    assert all(layer._compiled_call_impl is not None for layer in decoder.layers)
    assert decoder.norm._compiled_call_impl is not None and decoder.layers[0].mlp._compiled_call_impl is None
    _assert_same_step(compiled, eager, atol=1e-5)


def test_unsupported_settings_fail_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        LearnerConfig(varlen_attention=True)
    assert info.value.field == "LearnerConfig.varlen_attention" and "packing" in str(info.value)
    lin = torch.nn.Linear(2, 2)
    for cfg, field in ((LearnerConfig(packing=True, varlen_attention=True), "varlen_attention"),
                       (LearnerConfig(compile_elementwise=True), "compile_elementwise"),
                       (LearnerConfig(compile_layers=True), "compile_layers")):
        with pytest.raises(ConfigError) as info:
            LocalBackend(lin, torch.optim.SGD(lin.parameters(), lr=0.1), GRPOLoss(LossConfig()), cfg)
        assert info.value.field == f"LearnerConfig.{field}"


def test_compiled_head_maths_equals_eager_with_entropy_and_temperature() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    targets = torch.randint(0, 300, (37,))
    weights = torch.randn(37), torch.randn(37)
    results = []
    for compiled in (False, True):
        lp, ent = chosen_logprobs(hidden, weight, targets, 0.7, with_entropy=True, compiled=compiled)
        grads = torch.autograd.grad((lp * weights[0]).sum() + (ent * weights[1]).sum(), (hidden, weight))
        results.append((lp, ent, *grads))
    for eager, fused in zip(*results):
        torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)


def test_varlen_under_autocast_runs_in_the_autocast_dtype(model, varlen_model, monkeypatch) -> None:
    seen: list[torch.dtype] = []
    real = varlen.varlen_causal
    monkeypatch.setattr(varlen, "varlen_causal", lambda q, *a: seen.append(q.dtype) or real(q, *a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = completion_logprobs(model, PROMPTS, COMPLETIONS, packed=False)
        out = completion_logprobs(varlen_model, PROMPTS, COMPLETIONS, packed=True)
    assert seen and set(seen) == {torch.bfloat16}  # a float32 model's q/k/v, cast as sdpa casts them
    assert float((out.logprobs - ref.logprobs).detach().abs().max()) < 0.05  # bf16 rounding, not another result
