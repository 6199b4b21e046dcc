"""Helpers shared by tests (not fixtures), the one place a test module imports helpers from: test modules never
import each other. Here: the engine config the tests' vLLM engines use, weight perturbation, hand publication,
child processes, CPU burners. Beside it: ``algorithms`` (losses, packed and varlen steps), ``checkpoint``,
``embedded``, ``episodes``, ``pipelines`` (pipelines on the fake and the real engine), ``remote_engine`` (real vLLM
servers), ``remote_queue``, ``vllm_engine`` (the in-process engine); ``vllm_worker_ext``, loaded by name in vLLM's
workers; and ``scripts/``, run by torchrun or as subprocesses."""

from __future__ import annotations

from pathlib import Path


def engine_config(model_dir: Path, **overrides):
    from asyncrl.engines.vllm_local import VLLMEngineConfig

    args = dict(model=str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=32,
                extra={"worker_extension_cls": TEST_WORKER_EXTENSION})
    args.update(overrides)
    return VLLMEngineConfig(**args)


def perturb(model, seed: int):
    """Move ``model``'s weights, in place, by Gaussian noise (sd 0.05, from ``seed``): far enough that an engine
    still on the old weights is told apart from one synced to these. Returns ``model``."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def load_hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def child_pids() -> set[int]:
    """Live descendants of this process, except multiprocessing's resource tracker (it lives as long as
    this process by design, and is started by the first engine)."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        line = command_line(p)
        if line is not None and "resource_tracker" not in line:
            out.add(p.pid)
    return out


async def apply_update(engine, update):
    """Prepare, load and release one update on an engine that is already paused (or needs no pause)."""
    prepared = await engine.prepare(update)
    try:
        await engine.load(prepared)
    finally:
        engine.release(prepared)


async def load_paused(engine, prepared) -> None:
    """Pause (KEEP, cache cleared), load an update already prepared, then resume and release it whatever happens:
    a publication done by hand, step by step."""
    from asyncrl.types import PauseMode

    await engine.pause(PauseMode.KEEP, clear_cache=True)
    try:
        await engine.load(prepared)
    finally:
        await engine.resume()
        engine.release(prepared)


TEST_WORKER_EXTENSION = "tests.support.vllm_worker_ext.TestWorkerExtension"

# What the tests' vLLM servers run with (tiny float32 models, no CUDA-graph capture); the launcher itself
# adds nothing but what asyncrl needs.
SERVER_TEST_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "128")


class CpuBurners:
    """``count`` processes spinning a core each, as a busy CI machine has beside the tests."""

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.procs: list = []

    def __enter__(self) -> "CpuBurners":
        import subprocess
        import sys

        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def living(procs):  # type: ignore[no-untyped-def]
    """Those of ``procs`` (psutil processes) still running; a zombie has exited (its parent, maybe init, has yet to
    reap it)."""
    import psutil

    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            pass
    return alive


def command_line(proc):  # type: ignore[no-untyped-def]
    """``proc``'s command line (a psutil process or a pid), or None once it has exited: a zombie included, its
    command line is gone (psutil's ZombieProcess is a NoSuchProcess)."""
    import psutil

    try:
        return " ".join((psutil.Process(proc) if isinstance(proc, int) else proc).cmdline())
    except psutil.NoSuchProcess:
        return None


def describe(procs):  # type: ignore[no-untyped-def]
    """Each process (psutil's, or a pid) as its pid and the start of its command line, for a failure message;
    one that exited meanwhile reads as gone."""
    return [f"{getattr(p, 'pid', p)}: {(command_line(p) or 'gone')[:120]}" for p in procs]
