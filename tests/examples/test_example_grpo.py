"""``asyncrl/examples/grpo_offpolicy.py`` end to end, as a user runs it: a real subprocess, the real vLLM engine.

Run A trains a tiny model built from a 5-line prompts file (plain, chat-format and GSM8K-style rows). Run B
starts from the model run A saved (``--model``) on the built-in addition task, which proves vLLM loads the
saved model and generates with it, and trains a LoRA adapter on it (``--lora``: adapter-only publication into an
engine serving adapters, every publication probed, the KL reference the base itself). Both runs take a few steps
so the module stays around two minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.examples import common, tracking

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "64", "--layers", "1", "--warm-max-steps", "10", "--steps", "3", "--n", "4",
        "--batch-groups", "2", "--eval-every", "2", "--held-out", "20", "--tensorboard", "off", "--no-progress"]
PROMPTS = [
    {"prompt": "3+4=", "answer": "7"},
    {"prompt": "12+30=", "answer": "42"},
    {"prompt": "5+5=", "answer": "10"},
    {"prompt": [{"role": "user", "content": "20+21="}], "reward_model": {"ground_truth": "41"}},  # verl style
    {"prompt": "9+9=", "answer": "#### 18"},  # GSM8K answer style
]


def run_example(out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "asyncrl.examples.grpo_offpolicy", "--out", str(out), *TINY, *extra],
                          cwd=ROOT,
                          env=None if env is None else {**os.environ, **env},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"example failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    tmp = tmp_path_factory.mktemp("example")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    a = run_example(tmp / "a", "--prompts", str(prompts))
    # In-process engine core for run B: starts in ~9 s instead of ~20 s; the model load path is the same.
    b = run_example(tmp / "b", "--model", str(tmp / "a" / "model"), "--steps", "2", "--lora", "--lora-rank", "8",
                    "--kl-coef", "0.05", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return {"a": (tmp / "a", a.stdout), "b": (tmp / "b", b.stdout)}


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_prompts_file_run_writes_metrics_plot_and_summary(runs) -> None:
    out, stdout = runs["a"]
    assert "task prompts: 4 training / 1 held-out problems" in stdout
    assert "held-out accuracy: before" in stdout and "-> after" in stdout
    rows = tracking.read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("loss/policy" in r and "loss/total" in r and "rollout/staleness_mean" in r for r in rows)
    assert any("eval/accuracy" in r for r in rows)
    png = out / "grpo_offpolicy.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stats"]["steps"] == 3 and summary["stats"]["samples_trained"] == 3 * 2 * 4
    assert summary["stats"]["unaccounted"] == 0


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_saved_model_loads_in_transformers(runs) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = runs["a"][0] / "model"
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([tok("3+4=").input_ids])
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_saved_model_loads_in_vllm_and_trains_an_adapter_on_it(runs) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.lora import LoraConfig, apply_lora, load_adapter_state, merged_state

    out, stdout = runs["b"]
    # Run B started a VLLMEngine on run A's saved model and generated with it (held-out eval, rollouts).
    assert "task arithmetic: 9000 training / 20 held-out problems" in stdout
    assert "held-out accuracy: before" in stdout
    assert not (out / "base").exists(), "--model must skip building and warm start"
    rows = tracking.read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all("train/reward_mean" in r for r in rows)
    # Each step published its adapter alone, and the probe found the engine serving exactly it.
    assert [r["learner/version"] for r in rows] == [1, 2]
    assert all(0 <= r["sync/probe_max_diff"] < 1e-3 for r in rows), [r.get("sync/probe_max_diff") for r in rows]
    assert all(r["loss/kl"] >= 0 for r in rows)  # the reference: the base under the adapter, switched off
    # The adapter on its own, and the merged model, which equals base + adapter.
    from safetensors.torch import load_file

    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    base = AutoModelForCausalLM.from_pretrained(str(runs["a"][0] / "model"), dtype=torch.float32)
    wrapped = apply_lora(base, LoraConfig(rank=8, alpha=32))
    load_adapter_state(wrapped, adapter)
    merged = AutoModelForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float32).state_dict()
    for name, tensor in merged_state(wrapped).items():
        assert torch.allclose(merged[name], tensor, atol=1e-6), name


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_checkpoints_every_k_steps_and_a_resumed_run_continues_the_step_count(tmp_path: Path) -> None:
    # One code path for both examples (tracking.build_pipeline); in-process engine cores start in seconds.
    fast, ckpt = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--held-out", "4", "--eval-every", "0",
             "--rollout-log", str(tmp_path / "log")]
    run_example(tmp_path, "--steps", "4", *flags, env=fast)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000002", "step-000004"]
    resumed = run_example(tmp_path, "--steps", "6", "--resume", "latest", *flags, env=fast)
    assert f"resumed from {ckpt / 'step-000004'}: step 4" in resumed.stdout
    assert "resuming: model config and tokenizer from" in resumed.stdout, "no second warm start"
    rows = tracking.read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[4]["learner/version"] == rows[3]["learner/version"] + 1  # weights published, then trained on
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000002", "step-000004", "step-000006"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["start_step"] == 4 and summary["stats"]["steps"] == 6 and summary["stats"]["unaccounted"] == 0
    # The rollout log of both runs replays, with the lr schedule, to each later checkpoint's weights exactly.
    for start, until in ((2, 4), (4, 6)):
        assert replayed_max_diff(tmp_path, ckpt / f"step-{start:06d}", until, ckpt / f"step-{until:06d}") == 0.0


def replayed_max_diff(run: Path, checkpoint: Path, until: int, expected: Path) -> float:
    """``asyncrl replay`` (as ``python -m asyncrl.replay``) from ``checkpoint`` to step ``until``, against the
    weights of the checkpoint ``expected``."""
    from safetensors.torch import load_file

    saved = run / f"replayed-{until}.safetensors"
    proc = subprocess.run([sys.executable, "-m", "asyncrl.replay", "replay", str(run / "log"), "--checkpoint",
                           str(checkpoint), "--until", str(until), "--save", str(saved)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = load_file(str(saved)), load_file(str(expected / "model.safetensors"))
    shared = got.keys() & want.keys()
    assert shared and len(shared) >= len(want) - 1, (sorted(got), sorted(want))
    return max(float((got[k] - want[k]).abs().max()) for k in shared)


# ----------------------------------------------------------------------------------- fast, no engine


def test_answer_reward_exact_and_gsm8k_style() -> None:
    assert common.answer_reward(" 42 ", "42") == 1.0
    assert common.answer_reward("41", "42") == 0.0
    assert common.answer_reward("so the total is 1,234", "#### 1234") == 1.0  # last number vs GSM8K answer
    assert common.answer_reward("1234 then 5", "1234") == 0.0
    assert common.answer_reward("blue", "Blue") == 0.0


def test_prompts_file_parquet_in_verl_format(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "reward_model": {"ground_truth": str(i + 1)}}
            for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task = common.load_prompts_file(tmp_path / "train.parquet", n_held_out=200)
    assert len(task.train) == 8 and len(task.held_out) == 2
    assert all(isinstance(ex.prompt, list) for ex in task.train)
    ex = task.held_out[0]
    assert task.reward(ex.answer, ex.answer) == 1.0


def test_lr_schedule_ramps_up_then_decays_to_zero_at_the_last_step() -> None:
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hook = tracking.lr_schedule(optimizer, warmup=2, decay_to=4)
    seen = [optimizer.param_groups[0]["lr"]]
    for step in range(1, 5):
        optimizer.step()  # the learner steps, then runs its hooks
        hook(step, {})
        seen.append(optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([0.5, 0.75, 0.5, 0.25, 0.0])
    flat = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    flat_hook = tracking.lr_schedule(flat, warmup=0, decay_to=0)
    flat.step()
    flat_hook(1, {})
    assert flat.param_groups[0]["lr"] == 1.0


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_online_dpo_example_runs_xpo_on_a_lora_engine_and_its_base(runs, tmp_path: Path) -> None:
    """``asyncrl.examples.online_dpo`` end to end on run A's model: XPO with LoRA, so the frozen reference is the
    engine's base (requests without the adapter, no second engine), and a judge derived from the digits reward
    (exact matches would all tie on this model). The second-engine path is tests/preference's."""
    out = tmp_path / "xpo"
    proc = subprocess.run([sys.executable, "-m", "asyncrl.examples.online_dpo", "--out", str(out), *TINY,
                           "--model", str(runs["a"][0] / "model"), "--trainer", "xpo", "--reward", "digits",
                           "--steps", "2", "--lora", "--lora-rank", "8"],
                          cwd=ROOT, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"example failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "XPO: 2 steps" in proc.stdout and "held-out accuracy: before" in proc.stdout
    rows = tracking.read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 2 and "loss/xpo_exploration" in rows[-1] and rows[-1]["judge/opponent_samples"] > 0
    assert (out / "online_dpo.png").is_file() and (out / "model" / "config.json").is_file()
    assert (out / "adapter").is_dir(), "a LoRA run exports its adapter beside the merged model"
