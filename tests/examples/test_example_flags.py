"""The examples' tracking flags, in process and fast (no engine): sinks asked for but not installed are refused at
argument parsing naming the extra to install, ``auto`` names the sinks in one line, the checkpoint flags are checked
and resolved; ``tool_use`` takes the same flags as ``grpo_offpolicy`` (one code path, ``tracking.py``, covered
end to end by ``test_example_grpo.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from asyncrl.examples import grpo_offpolicy, online_dpo, tool_use, tracking
from asyncrl.metrics import make_monitor, optional_sinks

EXAMPLES = [grpo_offpolicy, tool_use, online_dpo]
MISSING = [p for p in ("tensorboard", "wandb") if importlib.util.find_spec(p) is None]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("package", MISSING)
def test_a_sink_asked_for_but_not_installed_is_refused_naming_its_extra(example, package, capsys):
    flags = ["--tensorboard", "on"] if package == "tensorboard" else ["--wandb", "my-project"]
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(flags)
    assert exit_.value.code == 2
    assert f"pip install 'asyncrl[{package}]'" in capsys.readouterr().err


@pytest.mark.parametrize("package", MISSING)
def test_the_library_refuses_too(package, tmp_path: Path):
    with pytest.raises(RuntimeError, match=rf"pip install 'asyncrl\[{package}\]'"):
        make_monitor(tmp_path, **{package: "on"})
    assert optional_sinks(**{package: "auto"}) == (False, False), "auto stays silent when it is missing"


def test_auto_names_the_active_sinks_in_one_line(tmp_path: Path, capsys):
    args = grpo_offpolicy.parse_args(["--out", str(tmp_path), "--wandb-run-name", "unused"])
    monitor = tracking.open_monitor(args, {})
    monitor.close()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("metrics: ") and str(tmp_path / "metrics.jsonl") in out[0]
    if "tensorboard" in MISSING:
        assert "pip install 'asyncrl[tensorboard]'" in out[0]


@pytest.mark.parametrize("example", EXAMPLES[:2], ids=lambda m: m.__name__.rsplit(".", 1)[-1])  # online_dpo: below
def test_checkpoint_flags_are_checked_and_resolved(example, tmp_path: Path, capsys):
    ckpt = tmp_path / "ckpt"
    args = example.parse_args(["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--wandb-run-name", "x"])
    assert args.checkpoint_dir == ckpt and args.checkpoint_every == 2 and args.resume is None
    for flags, message in ((["--checkpoint-every", "2"], "needs K >= 0 and --checkpoint-dir"),
                           (["--resume", "latest"], "--resume latest needs --checkpoint-dir"),
                           (["--checkpoint-dir", str(ckpt), "--resume", "latest"], "no complete checkpoint")):
        with pytest.raises(SystemExit):
            example.parse_args(flags)
        assert message in capsys.readouterr().err


async def test_resume_latest_resolves_to_the_newest_checkpoint(tmp_path: Path):
    import torch

    from asyncrl.checkpoint import CheckpointConfig, Checkpointer, TrainingState
    from asyncrl.counters import GroupTotals

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    async with Checkpointer(CheckpointConfig(dir=tmp_path, every_steps=1)) as writer:
        for step in (2, 4):
            await writer.save(model, optimizer, TrainingState(step, step, True, step * 3, GroupTotals()))
    args = tool_use.parse_args(["--checkpoint-dir", str(tmp_path), "--resume", "latest"])
    assert args.resume == str(tmp_path / "step-000004")
    assert tracking.resume_point(args).step == 4
    assert tracking.resume_point(grpo_offpolicy.parse_args(["--resume", str(tmp_path)])).step == 4
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 7)))
    assert tracking.start_metrics(out, tracking.resume_point(args)) == 4
    assert [r["step"] for r in tracking.read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_data_flags_name_what_is_wrong(tmp_path: Path, tiny_model_dir: Path):
    from asyncrl.examples import common

    prompts = tmp_path / "gsm8k.jsonl"
    prompts.write_text('{"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=5 #### 5"}\n' * 10)
    for flags, says in [(["--chat-template", "on"], "the tiny model has none"),
                        (["--chat-template", "on", "--model", str(tiny_model_dir)], f"{tiny_model_dir} has none"),
                        (["--prompts", str(prompts), "--reward", "digits"], "--reward digits is for the addition")]:
        with pytest.raises(SystemExit, match=says):
            common.task_from_args(grpo_offpolicy.parse_args(flags))
    with pytest.raises(ValueError, match="no_such_module"):
        common.task_from_args(grpo_offpolicy.parse_args(["--reward", "no_such_module:fn"]))
    task = common.task_from_args(grpo_offpolicy.parse_args(["--prompts", str(prompts), "--held-out", "2",
                                                            "--epochs", "3"]))
    assert task.epochs == 3 and task.train[0].answer == "5"  # GSM8K's question/answer layout, "#### N" kept


def test_online_dpo_takes_the_demo_flags_and_its_own(tmp_path: Path, capsys):
    args = online_dpo.parse_args(["--trainer", "nash_md", "--beta", "0.2", "--loss-type", "ipo", "--n", "4"])
    assert (args.trainer, args.beta, args.loss_type, args.n) == ("nash_md", 0.2, "ipo", 4)
    assert args.out == Path("runs/online_dpo") and args.lr == online_dpo.DPO_LR
    with pytest.raises(SystemExit):
        online_dpo.parse_args(["--resume", "latest", "--checkpoint-dir", str(tmp_path)])
    assert "--resume: not offered for the preference trainers" in capsys.readouterr().err
