"""Scoring from hidden states (``asyncrl.algorithms.head``) against scoring from the model's full logits: same
log-probs, entropies and gradients, chunked or not, padded or packed, under autocast too; and the models that
must keep the whole-model path get it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from asyncrl.algorithms import head as head_mod
from asyncrl.algorithms.logprobs import PLAIN, ScoringOptions, completion_logprobs

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]]
COMPLETIONS = [[10, 11, 12, 13], [14], [15, 16, 17], [18, 19]]
MASKS = [None, [1], [1, 0, 1], None]  # a multi-turn row: its middle token is the environment's


def _qwen(vocab: int = 97) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg)


def _score(model: torch.nn.Module, fused: bool, **kw: Any) -> tuple[Any, dict]:
    model = copy.deepcopy(model)
    scoring = PLAIN if fused else ScoringOptions(from_logits=True)
    out = completion_logprobs(model, PROMPTS, COMPLETIONS, loss_masks=MASKS, scoring=scoring, **kw)
    weights = torch.arange(1.0, out.logprobs.shape[1] + 1)
    loss = (out.logprobs * weights).sum()
    if out.entropy is not None:
        loss = loss + 0.3 * (out.entropy * weights.flip(0)).sum()
    loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def _head_called(model: torch.nn.Module, scoring: ScoringOptions) -> bool:
    calls: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.no_grad():
            completion_logprobs(model, PROMPTS, COMPLETIONS, scoring=scoring)
    finally:
        hook.remove()
    return bool(calls)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("rows_per_chunk", [2, None])
def test_hidden_state_scoring_equals_logit_scoring(monkeypatch: pytest.MonkeyPatch, packed: bool, entropy: bool,
                                                   rows_per_chunk: int | None) -> None:
    model = _qwen()
    assert head_mod.decoder_and_head(model) is not None  # the path under test is the one taken
    assert not _head_called(model, PLAIN)  # the head's weight is used chunk by chunk, not its forward
    assert _head_called(model, ScoringOptions(from_logits=True))  # and the one compared with is the other
    if rows_per_chunk:  # 8 scored tokens in chunks of 2: the chunk loop and its boundaries are exercised
        monkeypatch.setattr(head_mod, "CHUNK_ELEMENTS", rows_per_chunk * 97)
    kw = {"temperature": 0.7, "with_entropy": entropy, "packed": packed}
    fused, fused_grads = _score(model, True, **kw)
    whole, whole_grads = _score(model, False, **kw)
    assert fused.num_scored == 9 == int(whole.mask.sum())
    torch.testing.assert_close(fused.logprobs, whole.logprobs, atol=1e-5, rtol=1e-5)
    assert bool((fused.logprobs[2, 1] == 0) & (fused.logprobs[1, 1:] == 0).all())  # unscored: exactly 0
    if entropy:
        torch.testing.assert_close(fused.entropy, whole.entropy, atol=1e-5, rtol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_hidden_state_scoring_under_bf16_autocast() -> None:
    model = _qwen()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused, fused_grads = _score(model, True, with_entropy=True)
        whole, whole_grads = _score(model, False, with_entropy=True)
    assert fused.logprobs.dtype == torch.float32
    torch.testing.assert_close(fused.logprobs, whole.logprobs, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused.entropy, whole.entropy, atol=2e-2, rtol=2e-2)
    for name, grad in whole_grads.items():
        assert fused_grads[name].dtype == grad.dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(fused_grads[name].flatten(), grad.flatten(), dim=0)
        assert cos > 0.99, name


def test_scoring_without_grad_keeps_no_graph() -> None:
    model = _qwen()
    with torch.no_grad():
        out = completion_logprobs(model, PROMPTS, COMPLETIONS)
    assert not out.logprobs.requires_grad and out.logprobs.shape == (4, 4)


def test_models_that_need_their_own_forward_keep_it(tmp_path: Any) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert head_mod.decoder_and_head(gpt2) is None  # not a known plain-head architecture
    assert head_mod.decoder_and_head(torch.nn.Linear(2, 2)) is None

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = _qwen()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert head_mod.decoder_and_head(model) is None  # root parameters are gathered by the root's forward
        out = completion_logprobs(model, PROMPTS, COMPLETIONS)  # and the whole-model path scores it
        want = completion_logprobs(_qwen(), PROMPTS, COMPLETIONS)
        torch.testing.assert_close(out.logprobs, want.logprobs, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()
