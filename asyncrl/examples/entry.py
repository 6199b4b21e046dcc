"""The examples' console scripts (pyproject.toml ``[project.scripts]``), with the exit codes their
``python -m`` forms have (``common.run_cli``).

    asyncrl-grpo              asyncrl.examples.grpo_offpolicy
    asyncrl-online-dpo        asyncrl.examples.online_dpo
    asyncrl-tool-use          asyncrl.examples.tool_use
    asyncrl-openai-agent      asyncrl.examples.openai_agent
    asyncrl-distributed-grpo  asyncrl.examples.distributed_grpo (under torchrun)
    asyncrl-embedded-service  asyncrl.examples.embedded_service (needs ASYNCRL_TOKEN)
    asyncrl-remote-learner    asyncrl.examples.remote_learner (needs ASYNCRL_TOKEN)

Each module is imported only when its script runs: ``--help`` of one does not load the others. Imports go one
way: this module imports the examples, and no example imports it.
"""

from __future__ import annotations

from asyncrl.examples.common import run_cli


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
