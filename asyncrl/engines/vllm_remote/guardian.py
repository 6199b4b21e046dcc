"""The guardian of one vLLM server: it makes the server die with the process that started it.

``start_vllm_server`` runs ``python -I guardian.py --starter PID [--remove PATH]... -- SERVER COMMAND`` in a new
session; the guardian's pid is the process group's id, and it starts the server (API process, which spawns an
EngineCore and a worker) inside that group. It waits on three events and polls nothing while the server runs:

- the starter exits, however it dies (SIGKILL included): a pidfd of the starter becomes readable. The guardian
  SIGTERMs the group, SIGKILLs whatever is left after ``--grace`` seconds, removes the ``--remove`` paths (the
  socket directory, a temporary log) and exits;
- the server exits: the rest of the group gets ``--grace`` seconds to follow, then SIGKILL; the guardian exits
  the way the server did (same code, or same signal), so its starter sees the server's own exit;
- a signal (the starter's ``ServerProcess.stop`` SIGTERMs the whole group): nothing to do but wait for the
  server's exit.

Why a process, and why a pidfd: ``PR_SET_PDEATHSIG`` fires when the parent *thread* ends (servers are started
from worker threads and event loops in threads) and reaches only the direct child, not the EngineCore and
worker. A pipe whose end the starter holds also reaches a child the starter forks without exec (vLLM's forked
EngineCore of an in-process engine, data-loader workers), which would keep the server alive as long as it
lives. A pidfd names exactly the starter's process (Linux >= 5.3).

Run by path with ``-I`` (standard library only): importing the asyncrl package costs seconds and hundreds of
MiB, which a process that lives as long as the server should not hold. Linux only (it reads /proc).
"""

from __future__ import annotations

import argparse
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 10.0  # after SIGTERM, before SIGKILL
_POLL_S = 0.05  # descendants are not our children: no exit event for them, their group is re-read


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _others() -> list[int]:
    return [pid for pid in group_members(os.getpgrp()) if pid != os.getpid()]


def _end_group(server: subprocess.Popen[bytes], grace_s: float, terminate: bool) -> None:
    """Bring every other member of the group down: SIGTERM first if ``terminate``, SIGKILL after ``grace_s``."""
    if terminate:
        os.killpg(os.getpgrp(), signal.SIGTERM)  # we are in the group too: our handler ignores it
    deadline = time.monotonic() + grace_s
    while left := _others():
        if time.monotonic() >= deadline:
            for pid in left:  # one by one: a killpg would take the guardian before it cleans up
                _kill(pid)
        server.poll()  # reap the server as soon as it exits, or it stays a zombie member
        time.sleep(_POLL_S)
    server.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _watch_starter(pid: int) -> int | None:
    """A pidfd of the starter, or None if it is already gone (we were reparented before we looked)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    if os.getppid() != pid:  # it died before the pidfd was opened: the pid may be another process's now
        os.close(fd)
        return None
    return fd


def _remove(paths: list[str]) -> None:
    for path in map(Path, paths):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _exit_like(returncode: int) -> int:
    """The server's exit status as ours: its code, or death by its signal."""
    if returncode < 0:
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot have a handler
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    return returncode if returncode >= 0 else 128 - returncode


def serve(starter: int, command: list[str], remove: list[str], grace_s: float) -> int:
    starter_fd = _watch_starter(starter)
    if starter_fd is None:
        _remove(remove)
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a handler, not SIG_IGN: the server must not inherit it
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)  # our group; stdout and stderr: the log
    with selectors.DefaultSelector() as events:
        events.register(starter_fd, selectors.EVENT_READ, "starter")
        events.register(os.pidfd_open(server.pid), selectors.EVENT_READ, "server")
        events.register(wake_r, selectors.EVENT_READ, "signal")
        while True:
            for key, _ in events.select():
                if key.data == "starter":
                    print(f"asyncrl guardian: starter {starter} is gone; stopping the server", flush=True)
                    _end_group(server, grace_s, terminate=True)
                    _remove(remove)
                    return 1
                if key.data == "server":
                    _end_group(server, grace_s, terminate=False)
                    return _exit_like(server.returncode)
                os.read(wake_r, 512)  # a SIGTERM to the group: the server's exit follows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run a vLLM server that dies with its starter.")
    p.add_argument("--starter", type=int, required=True, help="pid of the process the server must not outlive")
    p.add_argument("--remove", action="append", default=[], help="a path removed once the starter is gone")
    p.add_argument("--grace", type=float, default=GRACE_S, help="seconds from SIGTERM to SIGKILL")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the server's command line")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no server command after --")
    return serve(args.starter, command, args.remove, args.grace)


if __name__ == "__main__":
    sys.exit(main())
