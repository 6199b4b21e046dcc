"""torch's flash varlen kernel behind ``algorithms.varlen`` on a CUDA GPU, against the per-sequence reference,
and a bf16 learner's log-probs and gradients under varlen (eager, compiled element-wise chains, or compiled
layers) against padded sdpa. Deselected by default:

    python3 -m pytest -m gpu tests/algorithms/test_gpu_varlen.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.algorithms import completion_logprobs, varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("kv_heads", [14, 2])  # plain and grouped-query heads (Qwen2-0.5B: 14 and 2)
def test_flash_varlen_matches_the_reference_forward_and_backward(kv_heads: int) -> None:
    torch.manual_seed(0)
    lengths = [300, 1, 77, 1024, 5]
    seg = varlen.Segments.from_lengths(lengths, torch.device("cuda"))
    q = torch.randn(sum(lengths), 14, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lengths), kv_heads, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)
    outs, grads = [], []
    for kernel in (varlen.varlen_causal, varlen.reference_varlen_causal):  # flash (bf16 on CUDA), then reference
        out = kernel(q, k, v, seg, 0.125)
        outs.append(out.float())
        grads.append([g.float() for g in torch.autograd.grad(out, (q, k, v), grad)])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("compiled", ["off", "elementwise", "layers"])
def test_bf16_learner_scores_and_gradients_match_padded_sdpa(compiled: str) -> None:
    from torch._dynamo.utils import counters
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.actors.training import compile_elementwise, compile_layers
    from asyncrl.algorithms import ScoringOptions

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    lengths = [(int(p), int(c)) for p, c in zip(torch.randint(5, 200, (12,), generator=gen),
                                                 torch.randint(1, 400, (12,), generator=gen))]
    prompts = [torch.randint(1, 512, (p,), generator=gen).tolist() for p, _ in lengths]
    completions = [torch.randint(1, 512, (c,), generator=gen).tolist() for _, c in lengths]
    fast = copy.deepcopy(model)
    varlen.install(fast)
    if compiled != "off":
        (compile_layers if compiled == "layers" else compile_elementwise)(fast)
    counters.clear()
    results = []
    for m, packed in ((model, False), (fast, True)):
        scoring = ScoringOptions(packed=packed, compiled_head=compiled != "off" and packed)
        out = completion_logprobs(m, prompts, completions, scoring=scoring)
        (out.logprobs.sum() / out.mask.sum()).backward()
        results.append((out, torch.cat([p.grad.float().flatten() for p in m.parameters()])))
    (ref, ref_grad), (got, got_grad) = results
    diff = (got.logprobs - ref.logprobs).detach().abs().sum() / ref.mask.sum()
    assert float(diff) < 0.02  # mean |difference| per scored token, bf16
    assert float(torch.nn.functional.cosine_similarity(got_grad, ref_grad, dim=0)) > 0.999
    if compiled == "layers":  # the flash kernel is traced into each layer's graph, not a break in it
        assert not counters["graph_break"], dict(counters["graph_break"])
