"""CPU checks of the pieces the GPU benchmarks stand on: the countdown task (lengths, reward), the start-up
probe's reading of vLLM's log lines, and the stand-in for TRL's attention kernel. (The benchmarks themselves run
end to end on CPU with ``python -m bench.gpu.workload --cpu-smoke``.)"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import countdown, startup_probe


def test_countdown_lengths_are_long_tailed_and_prompts_in_range():
    problems = countdown.problems(0, 4000)
    lengths = [p.length for p in problems]
    assert 230 < statistics.mean(lengths) < 280, "mean answer length about 256"
    assert statistics.median(lengths) < statistics.mean(lengths), "right-skewed"
    assert max(lengths) == countdown.MAX_L and min(lengths) >= countdown.MIN_L
    words = [len(p.prompt.split()) for p in problems[:200]]
    assert min(words) >= 100 and max(words) <= 300
    assert countdown.length_of(problems[0].prompt) == problems[0].length


def test_countdown_reward_is_read_from_the_text():
    p = countdown.Problem("begin count down from " + countdown.number(5), 5)
    assert [countdown.value(countdown.number(k)) for k in (0, 27, 999)] == [0, 27, 999]
    assert countdown.reward(p.answer, 5) == 1.0
    assert countdown.reward(p.answer + " waaa", 5) == 5 / 6, "words after the 0: the end was missed"
    assert countdown.reward(" wwww" + p.answer, 5) == 0.0
    assert countdown.reward(" ".join(p.answer.split()[:3]), 5) == 3 / 6


def test_startup_probe_reads_phases_off_vllm_log_lines():
    lines = [(0.0, "PROBE import_s 9.50"), (10.0, "PROBE start_called"),
             (31.0, "(Worker pid=1) INFO 12-01 [gpu_model_runner.py:5348] Model loading took 0.93 GiB memory and "
                    "4.500000 seconds"),
             (40.0, "INFO [backends.py:1156] Dynamo bytecode transform time: 6.10 s"),
             (52.0, "INFO [backends.py:394] Compiling a graph for compile range (1, 8192) takes 11.20 s"),
             (60.0, "INFO [gpu_model_runner.py:6845] Graph capturing finished in 7 secs, took 0.50 GiB"),
             (61.0, "INFO [core.py:341] init engine (profile, create kv cache, warmup model) took 29.00 s "
                    "(compilation: 17.30 s)"),
             (63.5, "PROBE started start_s 53.50"), (70.0, "PROBE decode_tokens_per_s 12345.6")]
    out = startup_probe.phases(lines)
    assert out["load_s"] == 4.5 and out["dynamo_s"] == 6.1 and out["inductor_s"] == 11.2
    assert out["graph_capture_s"] == 7 and out["init_engine_s"] == 29.0 and out["start_s"] == 53.5
    assert out["spawn_s"] == pytest.approx(31.0 - 4.5 - 10.0) and out["after_init_s"] == pytest.approx(2.5)
    assert out["profile_kv_warmup_s"] == pytest.approx(29.0 - 6.1 - 11.2 - 7)
    assert out["decode_tokens_per_s"] == 12345.6 and out["import_s"] == 9.5


def test_trl_kernel_stand_in_matches_dense_causal_attention():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu" / "trl_kernels"))
    try:
        import kernels
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    q, k, v = torch.randn(7, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    cu_q, cu_k = torch.tensor([0, 3, 7]), torch.tensor([0, 5, 10])
    out = kernels._per_sequence(q, k, v, cu_q, cu_k, 0.25, True)
    for (q0, q1), (k0, k1) in zip([(0, 3), (3, 7)], [(0, 5), (5, 10)]):
        qs = q[q0:q1].transpose(0, 1)
        ks, vs = (x[k0:k1].repeat_interleave(2, 1).transpose(0, 1) for x in (k, v))
        scores = (qs @ ks.transpose(1, 2)) * 0.25
        allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(diagonal=(k1 - k0) - (q1 - q0))
        ref = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vs).transpose(0, 1)
        assert torch.allclose(out[q0:q1], ref, atol=1e-5), "bottom-right causal, grouped KV heads"


def test_countdown_answers_reach_4096_tokens_at_a_chosen_mean():
    lengths = [p.length for p in countdown.problems(1, 3000, max_len=countdown.WORDS, mean_len=512)]
    assert 470 < statistics.mean(lengths) < 550 and max(lengths) > 2000 and max(lengths) <= countdown.WORDS
    with pytest.raises(ValueError, match="max_len"):
        countdown.problems(0, 1, max_len=countdown.WORDS + 1)


@pytest.fixture(scope="module")
def planted_tiny(tmp_path_factory):
    from bench.gpu import planted

    out = tmp_path_factory.mktemp("planted")
    info = planted.plant(out, "tiny-untied", token_error=0.01, device="cpu")
    return out, info


def test_a_planted_policy_counts_down_with_the_error_it_was_given(planted_tiny):
    """Teacher-forced over whole answers: the right token is the argmax everywhere, its probability is about
    1 - token_error, and ids beyond the tokenizer are never sampled."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, info = planted_tiny
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert info["params"] == sum(p.numel() for p in model.parameters())
    right, outside = [], []
    for p in countdown.problems(3, 6, max_len=300):
        prompt = tok(p.prompt, add_special_tokens=False).input_ids
        ids = prompt + tok(p.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float().softmax(-1)
        targets = torch.tensor(ids[len(prompt):])
        assert torch.equal(probs.argmax(-1), targets), "greedy decoding is the countdown, then end-of-sequence"
        right.append(probs.gather(1, targets[:, None]).mean().item())
        outside.append(probs[:, len(tok):].sum(-1).max().item())
    error = 1 - statistics.mean(right)
    assert 0.005 < error < 0.02, f"per-token error {error:.4f}, planted at 0.01"
    assert max(outside) < 1e-9


def test_planting_refuses_a_tied_head_and_an_impossible_error(tmp_path):
    from bench.gpu import planted

    with pytest.raises(ValueError, match="ties its head"):
        planted.plant(tmp_path, "tiny", device="cpu")
    with pytest.raises(ValueError, match="token_error"):
        planted.head_scale(128, 5000, 4000, 0.0)
    assert planted.head_scale(3584, 5000, 4097, 1e-4) > planted.head_scale(3584, 5000, 4097, 1e-2)


def test_flop_count_follows_the_shape_and_the_kind_of_training(planted_tiny):
    from transformers import AutoModelForCausalLM

    from bench import common
    from bench.gpu.mfu import FlopCount

    model = AutoModelForCausalLM.from_pretrained(str(planted_tiny[0]), dtype=torch.float32)
    groups = common.synthetic_groups(2, 2, 10, (5, 5), model.config.vocab_size, 0)
    cfg = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    s, c = 15, 5  # each sequence: a 10-token prompt and 5 completion tokens
    head, attention = cfg.hidden_size * cfg.vocab_size, cfg.num_hidden_layers * cfg.hidden_size
    forward = 2 * body * s + 2 * head * c + 2 * attention * s * s
    assert FlopCount(model, lora=False).batch_flops(groups) == pytest.approx(3 * 4 * forward)
    assert FlopCount(model, lora=True).batch_flops(groups) == pytest.approx(2 * 4 * forward)


def test_a_run_log_gives_each_sides_step_times(tmp_path):
    from bench.report.seven_b import logged_steps

    log = tmp_path / "run.log"
    log.write_text("engine up\nstep 1 ends at 4.0s\nstep 2 ends at 9.5s\nnoise step 3\n"
                   "step 1 ends at 30.0s\nWARNING x\nstep 2 ends at 70.5s\nstep 3 ends at 111.0s\n")
    assert logged_steps(log) == [[4.0, 9.5], [30.0, 70.5, 111.0]]


def test_the_llama_shape_plants_the_same_table(tmp_path, monkeypatch):
    """``llama3.1-8b`` at a tiny size: Llama's tensor names (no q/k/v biases) load into transformers' Llama and
    count down greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.gpu import planted

    monkeypatch.setitem(countdown.SHAPES, "tiny-llama", dict(
        countdown.SHAPES["llama3.1-8b"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, vocab_size=5120))
    planted.plant(tmp_path, "tiny-llama", device="cpu")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    p = countdown.problems(5, 1, max_len=40)[0]
    prompt = tok(p.prompt, add_special_tokens=False).input_ids
    ids = prompt + tok(p.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    with torch.no_grad():
        greedy = model(torch.tensor([ids])).logits[0, len(prompt) - 1:-1].argmax(-1)
    assert greedy.tolist() == ids[len(prompt):]


def test_the_peer_is_killed_before_the_deadline_with_room_to_write(tmp_path):
    """TRL's timeout is cut to end ``EXIT_GRACE_S`` before ``--deadline-s`` (counted from the run's start), so its
    partial steps are written before the command's own limit kills the run; without a deadline it stands."""
    from bench.gpu.workload import EXIT_GRACE_S, Report, parse_args

    args = parse_args(["--out", str(tmp_path), "--cpu-smoke", "--trl-timeout", "500", "--deadline-s", "300"])
    report = Report(args, None)
    assert 300 - EXIT_GRACE_S - 5 < report.peer_timeout() <= 300 - EXIT_GRACE_S
    report.t0 -= 400  # past the deadline: the least timeout, not a negative one
    assert report.peer_timeout() == 1.0
    report.args = parse_args(["--out", str(tmp_path), "--cpu-smoke", "--trl-timeout", "500"])
    assert report.peer_timeout() == 500


def test_a_side_is_expected_to_take_as_long_as_its_twin(tmp_path):
    """``async_fp8`` is budgeted from ``async`` measured earlier in the run (not the table's figure for every
    shape), and the time an engine still has to start counts against the deadline."""
    from bench.gpu.workload import EXIT_GRACE_S, SIDE_NEEDS_S, Report, parse_args

    report = Report(parse_args(["--out", str(tmp_path), "--cpu-smoke", "--deadline-s", "300"]), None)
    report.t0 -= 300 - SIDE_NEEDS_S["async_fp8"] + 10  # the table's figure no longer fits
    assert not report.time_left_for("async_fp8")
    measured = {"async": {"wall_s": 40.0}}  # its twin took 40 s: 40 * 1.25 + the grace fits the 140 s left
    assert 40 * 1.25 + EXIT_GRACE_S < SIDE_NEEDS_S["async_fp8"] - 10
    assert report.time_left_for("async_fp8", measured)
    assert not report.time_left_for("async_fp8", measured, engine_start_s=90.0)
    assert report.skipped == []  # asking does not record
    assert report.fits("async_fp8", measured)
    assert not report.fits("async_fp8", {"async": {"wall_s": 40.0, "partial": True}})  # a cut twin says nothing
    assert report.skipped == ["async_fp8"]


def test_no_engine_starts_when_none_of_its_sides_would_end_in_time(tmp_path):
    """``ours`` counts the run's earlier engine start against the deadline and, when no side of the variant would
    end, records them all as skipped and returns before starting (or even reading the model for) its engine."""
    import asyncio

    from bench.gpu.workload import Report, ours, parse_args

    args = parse_args(["--out", str(tmp_path), "--cpu-smoke", "--sides", "async,async_fp8", "--deadline-s", "300"])
    report = Report(args, None)
    report.t0 -= 150  # 150 s left: the twin's 80 s fit, not after a 90 s engine start
    out = {"engine_start_s": 90.0, "async": {"wall_s": 40.0}}
    asyncio.run(ours(args, tmp_path / "no-model-here", report, out, "fp8"))
    assert report.skipped == ["async_fp8"]
    assert "engine_start_s_fp8" not in out and "async_fp8" not in out


def test_the_precompile_twin_shares_the_frozen_weights_and_copies_the_trained_ones():
    """The learner is compiled on a throwaway twin: a LoRA base is shared, not copied (a second 7B base on the GPU),
    while what trains is the twin's own, so warming it up leaves the policy as it was."""
    from bench.gpu.workload import throwaway_twin

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    twin = throwaway_twin(model)
    assert twin[0].weight is model[0].weight and twin[0].bias is model[0].bias
    assert twin[1].weight is not model[1].weight and torch.equal(twin[1].weight, model[1].weight)
    before = model[1].weight.detach().clone()
    twin(torch.ones(3, 4)).sum().backward()
    torch.optim.SGD(twin.parameters(), lr=1.0).step()
    assert torch.equal(model[1].weight, before) and model[1].weight.grad is None
    assert not torch.equal(twin[1].weight, before)
