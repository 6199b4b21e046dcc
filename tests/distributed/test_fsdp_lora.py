"""LoRA under the FSDP2 learner on 2 CPU ranks (gloo, under torchrun; one launch for the module): the sharded
steps equal the single-process LoRA steps, the optimiser holds the adapter alone while the frozen base is sharded
and stays put, and an adapter-only sharded checkpoint resumes exactly (at 2 ranks, and in one process)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.actors.training import LocalBackend

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "scripts" / "fsdp_lora.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.1"]
STEPS = 3


def _script():  # type: ignore[no-untyped-def]
    """The rank script read as a module, for the constants it shares with these tests."""
    return importlib.import_module("tests.support.scripts.fsdp_lora")


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank run (tests/support/scripts/fsdp_lora.py), once for the module; its output folder."""
    out = tmp_path_factory.mktemp("fsdp_lora")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*TORCHRUN, str(SCRIPT), str(tiny_model_dir), str(out)], capture_output=True, text=True,
                          env=env, timeout=150, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _adapters(out: Path, leg: str, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    prefix = f"{leg}/{step}/"
    return {k[len(prefix):]: v for k, v in load_file(str(out / "adapters.safetensors")).items() if k.startswith(prefix)}


def _metrics(out: Path, leg: str) -> list[dict[str, float]]:
    return json.loads((out / "result.json").read_text())["metrics"][leg]


def _local(model_dir: Path, seed: int | None = None) -> LocalBackend:
    """The single-process LoRA learner on the same base; with ``seed``, the adapter rank 0 of the run made."""
    from asyncrl.lora import apply_lora
    from asyncrl.recipes import default_optimizer
    from tests.support import load_hf_model

    script = _script()
    base = load_hf_model(model_dir)
    torch.manual_seed(script.ADAPTER_SEED if seed is None else seed)
    model = apply_lora(base, script.LORA).train()
    # A sharded model is scored from its full logits, so this one is too (the step compared with it).
    cfg = dataclasses.replace(script.LEARNER, score_from_logits=True)
    return LocalBackend(model, default_optimizer(model, cfg), script.loss(), cfg)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst <= atol, worst


@pytest.mark.timeout(240)
def test_two_rank_lora_steps_equal_the_single_process_steps(run: Path, tiny_model_dir: Path) -> None:
    from asyncrl.lora import adapter_state
    from tests.support.scripts.fsdp_checkpoint import batches

    local = _local(tiny_model_dir)  # rank 1 seeded its adapter otherwise: shard_model gave it rank 0's
    sharded = _metrics(run, "first")
    for step, batch in enumerate(batches()):
        metrics = local.train_step(batch, step)  # from the full logits, as the sharded model (``_local``)
        assert metrics["loss/total"] == pytest.approx(sharded[step]["loss/total"], abs=1e-6)
        assert metrics["loss/kl"] == pytest.approx(sharded[step]["loss/kl"], abs=1e-7)
        assert metrics["train/grad_norm"] == pytest.approx(sharded[step]["train/grad_norm"], rel=1e-5)
        want = {k: v.detach().clone() for k, v in adapter_state(local.model).items()}
        _assert_close(_adapters(run, "first", step + 1), want, atol=1e-6)  # same PEFT names, same values
    assert sharded[-1]["loss/kl"] > 0  # the base served as the KL reference under FSDP too
    start = adapter_state(_local(tiny_model_dir).model)
    moved = {k: float((v - start[k]).abs().max()) for k, v in _adapters(run, "first", STEPS).items()}
    assert min(moved.values()) > 1e-4  # every adapter tensor, A and B, was trained
    # What the sharded learner publishes is the adapter alone; its probe scores equal the single process's.
    result = json.loads((run / "result.json").read_text())
    assert result["sources"][:STEPS] == ["AdapterWeights rank 4"] * STEPS
    from tests.support.scripts.fsdp_lora import PROBE

    assert result["probe"] == pytest.approx(local.score(PROBE), abs=1e-5)


@pytest.mark.timeout(240)
def test_the_optimiser_holds_the_adapter_alone_and_the_sharded_base_stays_frozen(run: Path) -> None:
    for rank in (0, 1):
        held = json.loads((run / f"rank{rank}.json").read_text())
        assert held["held"] == held["trainable"] and len(held["held"]) == 28  # 2 layers x 7 projections x (A, B)
        assert all(".lora_A." in n or ".lora_B." in n for n in held["held"])
        assert held["frozen"] == 26 and held["not_sharded"] == []  # the frozen base is sharded too
        assert held["frozen_with_grad"] == [] and held["base_moved"] == 0.0
        assert held["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    refused = json.loads((run / "result.json").read_text())["refused"]
    assert "must hold its adapter alone: it holds 26 frozen parameters" in refused


@pytest.mark.timeout(240)
def test_an_adapter_only_sharded_checkpoint_resumes_exactly(run: Path, tiny_model_dir: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from asyncrl.distributed.checkpoint import load_sharded
    from asyncrl.lora import adapter_state
    from tests.support import load_hf_model
    from tests.support.scripts.fsdp_checkpoint import batches

    ckpt = run / "ckpt"
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    tensors = [k for k in keys if not k.startswith("optim.param_groups.")]  # lr, betas...: the optimiser's settings
    assert len(tensors) == 28 * 4  # each adapter tensor, and its step, exp_avg and exp_avg_sq
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors), tensors  # no base weight, not even the tied head

    # 2 ranks, a fresh model and optimiser (another adapter) loaded from it: the uninterrupted run's step.
    for step in (2, 3):
        for name, tensor in _adapters(run, "resumed", step).items():
            assert torch.equal(tensor, _adapters(run, "first", step)[name]), (step, name)
    first, resumed = _metrics(run, "first")[2], _metrics(run, "resumed")[0]
    assert resumed["loss/total"] == first["loss/total"] and resumed["train/grad_norm"] == first["train/grad_norm"]

    # One process, no process group: an unsharded LoRA model reads it and takes the same third step.
    local = _local(tiny_model_dir, seed=123)
    meta = load_sharded(ckpt, local.model, local.optimizer)
    assert meta["step"] == 2 and meta["weights"] == "adapter"
    _assert_close({k: v.detach().clone() for k, v in adapter_state(local.model).items()},
                  _adapters(run, "first", 2), atol=0.0)
    local.train_step(batches()[2], 2)  # from the full logits (``_local``)
    _assert_close(dict(adapter_state(local.model)), _adapters(run, "first", 3), atol=1e-6)
    with pytest.raises(ValueError, match="holds a LoRA adapter"):
        load_sharded(ckpt, load_hf_model(tiny_model_dir))
