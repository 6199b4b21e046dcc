"""``VLLMEngineConfig.log_level``: a user's script that starts an engine is not flooded with vLLM's INFO lines
(about 120 per start, from this process and from the engine-core processes vLLM spawns), and a
``VLLM_LOGGING_LEVEL`` the user set in the environment still wins."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.engines.vllm_local import VLLMEngineConfig
from asyncrl.engines.vllm_local.config import engine_env, set_vllm_log_level

ROOT = Path(__file__).resolve().parents[3]

STARTER = """
import asyncio, sys
from asyncrl.engines.vllm_local import VLLMEngine
from tests.support import engine_config

async def main():
    engine = await VLLMEngine.start(engine_config(sys.argv[1], max_num_seqs=8))
    await engine.close()
    print("DONE", flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_the_level_reaches_the_spawned_processes_unless_the_environment_sets_one(tmp_path: Path) -> None:
    cfg = VLLMEngineConfig(model=str(tmp_path))
    assert engine_env(cfg, {})["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert "VLLM_LOGGING_LEVEL" not in engine_env(cfg, {"VLLM_LOGGING_LEVEL": "INFO"})  # the user's wins
    assert "VLLM_LOGGING_LEVEL" not in engine_env(VLLMEngineConfig(model=str(tmp_path), log_level=None), {})


def test_the_level_is_set_on_the_vllm_logger_unless_the_environment_sets_one(tmp_path: Path) -> None:
    logger = logging.getLogger("vllm")
    before = logger.level
    try:
        logger.setLevel(logging.INFO)
        set_vllm_log_level(VLLMEngineConfig(model=str(tmp_path), log_level="ERROR"), {"VLLM_LOGGING_LEVEL": "INFO"})
        assert logger.level == logging.INFO
        set_vllm_log_level(VLLMEngineConfig(model=str(tmp_path), log_level=None), {})
        assert logger.level == logging.INFO
        set_vllm_log_level(VLLMEngineConfig(model=str(tmp_path), log_level="ERROR"), {})
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)


def _start_and_close(model_dir: Path, tmp_path: Path, level: str | None) -> str:
    """Everything a script that starts and closes an engine prints, stdout and stderr together."""
    script = tmp_path / "starter.py"  # run by path, so vLLM's spawned processes can import its __main__
    script.write_text(STARTER)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"} | {"PYTHONPATH": str(ROOT)}
    if level is not None:
        env["VLLM_LOGGING_LEVEL"] = level
    done = subprocess.run([sys.executable, str(script), str(model_dir)], env=env, cwd=ROOT, timeout=240,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0 and "DONE" in done.stdout, done.stdout[-3000:]
    return done.stdout


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_engine_start_prints_no_info_lines_by_default(tiny_model_dir: Path, tmp_path: Path) -> None:
    quiet = _start_and_close(tiny_model_dir, tmp_path, None)
    assert [line for line in quiet.splitlines() if " INFO " in line] == []
    # The other side, a user's VLLM_LOGGING_LEVEL=INFO reaching every process (so this check can see INFO lines
    # when there are any), is shown by the embedded service's test: its engine logs at INFO, on stderr.
