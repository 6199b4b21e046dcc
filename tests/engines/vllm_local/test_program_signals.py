"""The README's program, run as a real process on the real engine, leaves nothing behind whatever signal ends it.

- SIGTERM (``timeout``, ``docker stop``, systemd, Kubernetes, Slurm): ``asyncrl.run`` cancels the run, the engine
  shuts down, the process exits 143 within seconds, and none of its files is left: no staging directory or
  shared-memory segment in /dev/shm, no socket directory, nothing in its temp directory.
- ``kill -9`` of its whole process group (the engine processes and ``multiprocessing``'s resource tracker with
  it): vLLM's shared-memory segments stay, and the next run collects them, by the dead starter's pid.

/dev/shm is shared with whatever else runs on the machine, so the test judges only what it can attribute to the
program: the segments its processes have mapped (by inode, from /proc/<pid>/maps) and directories named by its pid.
"""

from __future__ import annotations

import getpass
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[3]
SHM = Path("/dev/shm")
EXIT_S = 20.0  # from SIGTERM to every process of the program gone (measured: 3-6 s, with a CPU burner beside)


def readme_program(steps: int) -> str:
    text = (ROOT / "README.md").read_text()
    [code] = re.findall(r"<!-- snippet: run -->\n```python\n(.*?)```", text, re.S)[:1]
    assert "pipeline.run(steps=20)" in code, "the README program changed: update this test"
    return code.replace("pipeline.run(steps=20)", f"pipeline.run(steps={steps})")


@pytest.fixture
def place(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """The program's directory, and its own temp and socket directories (short: socket paths hold 107 bytes)."""
    dirs = {"work": tmp_path, "tmp": Path(tempfile.mkdtemp(prefix="sigt-")),
            "rpc": Path(tempfile.mkdtemp(prefix="sigr-"))}
    yield dirs
    for key in ("tmp", "rpc"):
        subprocess.run(["rm", "-rf", str(dirs[key])], check=False)


def start(place: dict[str, Path], steps: int) -> subprocess.Popen[str]:
    (place["work"] / "train.py").write_text(readme_program(steps))
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or f"{tempfile.gettempdir()}/torchinductor_{getpass.getuser()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(place["tmp"]),
           "VLLM_RPC_BASE_PATH": str(place["rpc"]), "TORCHINDUCTOR_CACHE_DIR": inductor}
    return subprocess.Popen([sys.executable, "train.py"], cwd=place["work"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for(proc: subprocess.Popen[str], needle: str, deadline_s: float = 300.0) -> str:
    seen: list[str] = []
    end = time.monotonic() + deadline_s
    assert proc.stdout is not None
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"{needle!r} not printed within {deadline_s}s:\n{''.join(seen)[-4000:]}")


def family(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def mapped_segments(procs: list[psutil.Process]) -> dict[str, int]:
    """The /dev/shm files (name -> inode) that ``procs`` have mapped. Matched by inode: a semaphore is mapped
    under the temporary name it was made under."""
    inodes = set()
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    inodes.add(int(fields[4]))
        except OSError:
            continue
    return {e.name: e.inode() for e in os.scandir(SHM) if e.is_file() and e.inode() in inodes}


def still_there(segments: dict[str, int]) -> list[str]:
    return [name for name, ino in segments.items() if (SHM / name).exists() and (SHM / name).stat().st_ino == ino]


def leftovers(pid: int, place: dict[str, Path], segments: dict[str, int], temp: bool = True) -> list[str]:
    """What the program left: directories named by its pid in /dev/shm, its segments, anything under its socket
    base and (``temp``) in its temp dir, less torch's compile cache (``torchinductor_<user>``, kept for later runs
    by design)."""
    named = [str(p) for p in SHM.iterdir() if re.search(rf"-{pid}-", p.name)]
    dirs = [place["rpc"], *([place["tmp"]] if temp else [])]
    files = [p for d in dirs for p in d.iterdir() if not p.name.startswith("torchinductor_")]
    return named + still_there(segments) + [str(p) for p in files]


def gone(procs: list[psutil.Process], timeout_s: float) -> tuple[list[int], int | None]:
    """Wait for ``procs`` to exit: the pids still running, and the first one's exit status (psutil reaps it, so
    ``Popen.wait`` would no longer see it)."""
    ended, alive = psutil.wait_procs(procs, timeout=timeout_s)
    status = next((p.returncode for p in ended if p.pid == procs[0].pid), None)
    return [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], status


def test_sigterm_cancels_the_run_and_leaves_nothing(place: dict[str, Path]) -> None:
    with start(place, steps=100_000) as proc:
        try:
            wait_for(proc, "step 3 |")
            procs = family(proc.pid)
            segments = mapped_segments(procs)
            assert segments, "the engine's processes map vLLM's shared-memory queues"
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            alive, status = gone(procs, EXIT_S)
            elapsed = time.monotonic() - t0
            out = proc.stdout.read() if proc.stdout else ""
            assert not alive, f"still running {elapsed:.1f}s after SIGTERM: {alive}\n{out[-3000:]}"
            assert status == 143, out[-3000:]
            assert "Traceback" not in out, out[-3000:]
            assert not leftovers(proc.pid, place, segments), (leftovers(proc.pid, place, segments), out[-3000:])
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


def test_kill_9_of_the_group_leaves_segments_the_next_run_collects(place: dict[str, Path]) -> None:
    with start(place, steps=100_000) as killed:
        try:
            wait_for(killed, "step 3 |")
            procs = family(killed.pid)
            segments = mapped_segments(procs)
            assert segments, "the engine's processes map vLLM's shared-memory queues"
        finally:
            os.killpg(killed.pid, signal.SIGKILL)
        assert not gone(procs, 30.0)[0]
    assert still_there(segments), "kill -9 of the whole group leaves vLLM's segments (nobody is left to remove them)"

    with start(place, steps=2) as after:
        out = wait_for(after, " steps, ")  # the program's last line
        assert after.wait(timeout=120) == 0, out[-3000:]
    assert not still_there(segments), "the next run collects the dead run's segments"
    # Not the temp dir, which both runs share: vLLM's rendezvous file (vllm_dist_*) of the killed run stays there
    # (an engine removes its own at close; nothing collects a dead run's).
    assert not leftovers(killed.pid, place, {}, temp=False), leftovers(killed.pid, place, {}, temp=False)
    assert not leftovers(after.pid, place, {}, temp=False), leftovers(after.pid, place, {}, temp=False)
