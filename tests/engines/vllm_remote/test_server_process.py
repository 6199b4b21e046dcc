"""What a vLLM server started by ``start_vllm_server`` inherits (no server is started here)."""

from __future__ import annotations

from asyncrl.engines.vllm_remote.process import DEFAULT_ENV, server_env


def test_a_server_started_from_a_torchrun_rank_sees_none_of_the_launchers_variables() -> None:
    rank_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "1",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0",
                "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": "/site"}
    env = server_env({"CUDA_VISIBLE_DEVICES": "1"}, base=rank_env)
    assert not {k for k in env if k in rank_env and k not in ("PATH", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")}
    assert env["PATH"] == "/usr/bin" and env["CUDA_VISIBLE_DEVICES"] == "1"  # the caller's env wins
    assert env["PYTHONPATH"] == "/site"  # as inherited: the server finds asyncrl the way its starter did
    assert all(env[k] == v for k, v in DEFAULT_ENV.items())


def test_the_server_helpers_are_exported_by_the_package() -> None:
    from asyncrl.engines import vllm_remote
    from asyncrl.engines.vllm_remote import process

    assert (vllm_remote.start_vllm_server, vllm_remote.ServerProcess, vllm_remote.free_port) == (
        process.start_vllm_server, process.ServerProcess, process.free_port)


def test_a_log_level_the_user_set_wins_over_the_servers_default() -> None:
    assert server_env(base={})["VLLM_LOGGING_LEVEL"] == "WARNING"  # vLLM's INFO lines are a hundred per start
    assert server_env(base={"VLLM_LOGGING_LEVEL": "DEBUG"})["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert server_env({"VLLM_LOGGING_LEVEL": "ERROR"}, base={"VLLM_LOGGING_LEVEL": "DEBUG"})[
        "VLLM_LOGGING_LEVEL"] == "ERROR"
    assert server_env(base={"VLLM_CPU_KVCACHE_SPACE": "9"})["VLLM_CPU_KVCACHE_SPACE"] == "1"  # others: as before
