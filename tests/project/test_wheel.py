"""The built wheel works alone: installed into a fresh virtualenv (the dependencies reached through a ``.pth``
line to the dev venv's site-packages, no source checkout on ``sys.path``), a program run from elsewhere imports the
public surface, builds a tiny model with ``asyncrl.testing``, starts the in-process engine (its worker extension
loaded in vLLM's own processes from the wheel) and trains two GRPO steps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent('''
    import asyncio
    import sys
    from pathlib import Path

    import asyncrl
    assert Path(asyncrl.__file__).is_relative_to(sys.prefix), (asyncrl.__file__, sys.prefix)
    import asyncrl.engines.vllm_remote
    import asyncrl.launch.ray  # noqa: F401  (the Ray launcher's module imports without a checkout)
    from asyncrl.engines.vllm_remote import start_vllm_server  # noqa: F401  (the server helpers are exported)
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig
    from asyncrl.metrics import JsonlSink, TensorBoardSink, WandbSink  # noqa: F401  (the sinks import)
    from asyncrl.examples import (  # noqa: F401  (the examples ship in the wheel, behind its console scripts)
        distributed_grpo, embedded_service, entry, grpo_offpolicy, remote_learner, sft, tool_use)
    from asyncrl.testing import build_tiny
    from asyncrl.testing.tasks import arithmetic


    async def main() -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = build_tiny("tiny", arithmetic.corpus())
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        policy = AutoModelForCausalLM.from_pretrained(str(model_dir))
        prompts = [asyncrl.Prompt(f"q{i}", tuple(tok(p.prompt).input_ids), p.prompt, p.answer)
                   for i, p in enumerate(arithmetic.split(64, 0)[0])]
        engine = await VLLMEngine.start(VLLMEngineConfig(model=str(model_dir), dtype="float32", max_model_len=128))
        config = asyncrl.PipelineConfig(
            producer=asyncrl.ProducerConfig(sampling=asyncrl.SamplingConfig(n=2, max_tokens=4)),
            learner=asyncrl.LearnerConfig(batch_groups=2, skip_inert_groups=False))
        reward = lambda prompt, sample: arithmetic.reward(sample.text, prompt.answer)
        pipeline = asyncrl.grpo_pipeline(engine, policy, prompts, reward, config, pad_id=tok.pad_token_id,
                                         monitor=JsonlSink("metrics.jsonl"))
        result = await pipeline.run(steps=2)
        assert result.steps == 2 and result.unaccounted == 0, result
        print("WHEEL-OK", asyncrl.__file__, result.steps)


    if __name__ == "__main__":
        asyncrl.run(main())
''')


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_wheel_runs_a_pipeline_with_no_source_checkout(tmp_path: Path) -> None:
    # Built from a copy, so that setuptools' build/ and egg-info never land in the checkout.
    src = tmp_path / "src"
    shutil.copytree(ROOT / "asyncrl", src / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                  "-w", str(tmp_path / "dist"), str(src)], tmp_path, env, 120)
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp_path / "dist").glob("asyncrl-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = _site_packages(python)
    (site / "dev-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dev venv's dependencies
    work = tmp_path / "work"
    work.mkdir()
    # A path line's own .pth files are not processed: the dev venv's editable asyncrl is not importable here.
    before = _run([str(python), "-c", "import vllm, torch; import asyncrl"], work, env, 120)
    assert "No module named 'asyncrl'" in before.stderr, before.stderr

    installed = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                      str(wheel)], work, env, 120)
    assert installed.returncode == 0, installed.stderr
    assert (site / "asyncrl" / "testing" / "tiny.py").exists()

    (work / "program.py").write_text(PROGRAM)
    ran = _run([str(python), "program.py"], work, env, 240)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-6000:]
    assert f"WHEEL-OK {site / 'asyncrl' / '__init__.py'} 2" in ran.stdout, ran.stdout[-3000:]
    assert (work / "metrics.jsonl").read_text().count("\n") >= 2
    assert "step 2 | v 2 |" in ran.stderr, ran.stderr[-3000:]  # the progress line, on stderr
    helped = _run([str(venv / "bin" / "asyncrl-remote-learner"), "--help"], work, env, 120)
    assert helped.returncode == 0 and "ASYNCRL_TOKEN" in helped.stdout, helped.stdout + helped.stderr[-3000:]
