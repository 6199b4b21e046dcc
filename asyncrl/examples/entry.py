"""The examples' console scripts (pyproject.toml ``[project.scripts]``), with the exit codes their
``python -m`` forms have, and the JSON event stream of the examples that print one.

    asyncrl-grpo              asyncrl.examples.grpo_offpolicy
    asyncrl-tool-use          asyncrl.examples.tool_use
    asyncrl-openai-agent      asyncrl.examples.openai_agent
    asyncrl-distributed-grpo  asyncrl.examples.distributed_grpo (under torchrun)
    asyncrl-embedded-service  asyncrl.examples.embedded_service (needs ASYNCRL_TOKEN)
    asyncrl-remote-learner    asyncrl.examples.remote_learner (needs ASYNCRL_TOKEN)

Each module is imported only when its script runs: ``--help`` of one does not load the others.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from asyncrl.runtime import Terminated


def run_cli(cli: Callable[[list[str] | None], int]) -> int:
    """Run an example's ``cli`` as its ``__main__`` block does: Ctrl-C exits 130 and SIGTERM (which ``asyncrl.run``
    turns into a cancellation, then ``Terminated``) 143, each with a line saying the run was cancelled, instead
    of a traceback."""
    try:
        return cli(None)
    except KeyboardInterrupt:
        print("\ninterrupted: run cancelled, engine shut down", file=sys.stderr)
        return 130
    except Terminated as exc:
        print("\nterminated: run cancelled, engine shut down", file=sys.stderr)
        return int(exc.code)


def grpo() -> int:
    from asyncrl.examples import grpo_offpolicy

    return run_cli(grpo_offpolicy.cli)


def online_dpo() -> int:
    from asyncrl.examples import online_dpo as example

    return run_cli(example.cli)


def tool_use() -> int:
    from asyncrl.examples import tool_use as example

    return run_cli(example.cli)


def openai_agent() -> int:
    from asyncrl.examples import openai_agent as example

    return run_cli(example.cli)


def distributed_grpo() -> int:
    from asyncrl.examples import distributed_grpo as example

    example.main()  # its result is printed as JSON lines already; not an exit status
    return 0


def embedded_service() -> int:
    from asyncrl.examples import embedded_service as example

    example.main()
    return 0


def remote_learner() -> int:
    from asyncrl.examples import remote_learner as example

    example.main()
    return 0


class JsonEvents:
    """One JSON line per event, on a stream of their own. ``take_stdout`` makes that stream the process's
    original stdout and sends everything else written there to stderr, so a program piping stdout reads only
    events."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out

    def emit(self, event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}), file=self.out or sys.stdout, flush=True)

    def take_stdout(self) -> None:
        """Keep a private duplicate of file descriptor 1 for the events, then point descriptor 1 (and
        ``sys.stdout``) at stderr. At the descriptor level, so that it also holds for writers that bound the old
        ``sys.stdout`` already (vLLM's log handler writes to stdout by default) and for child processes, which
        inherit descriptor 1 (vLLM's engine-core processes)."""
        sys.stdout.flush()
        self.out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
