"""The per-step progress line a pipeline prints to stderr (``PipelineConfig.progress``), on the fake engine."""

from __future__ import annotations

import dataclasses
import io
import re

import pytest

from asyncrl.engines.fake import FakeEngine
from asyncrl.metrics import ProgressLine, progress_line
from tests.support.pipelines import config, make_pipeline, prompts

LINE = re.compile(r"step (\d+) \| v (\d+) \| groups (\d+) \| reward \S+ \| staleness \d+\.\d\d( \| \d+ tok/s "
                  r"\d+\.\d\d steps/s)?( \| dropped \d+)?")


def test_the_line_shows_what_was_logged_and_leaves_out_what_was_not() -> None:
    metrics = {"learner/version": 12, "groups/trained": 24, "train/reward_mean": 0.4213,
               "rollout/staleness_batch_mean": 0.5, "groups/dropped": 3, "tokens/trained": 999}
    assert progress_line(12, metrics, (1520.4, 2.1)) == (
        "step 12 | v 12 | groups 24 | reward 0.421 | staleness 0.50 | 1520 tok/s 2.10 steps/s | dropped 3")
    assert progress_line(1, {"learner/version": 1, "groups/dropped": 0}) == "step 1 | v 1"


def test_rates_are_over_the_time_since_the_previous_line() -> None:
    now = iter([10.0, 12.0])
    out = io.StringIO()
    line = ProgressLine(out, clock=lambda: next(now))
    line.log(1, {"tokens/trained": 100})
    line.log(3, {"tokens/trained": 500})
    assert out.getvalue().splitlines() == ["step 1", "step 3 | 200 tok/s 1.00 steps/s"]


@pytest.mark.parametrize("progress", [True, False])
async def test_a_pipeline_prints_one_line_per_step_to_stderr_unless_asked_not_to(
        progress: bool, capsys: pytest.CaptureFixture[str]) -> None:
    pipe = make_pipeline(FakeEngine(), prompts(100), dataclasses.replace(config(), progress=progress))
    await pipe.run(steps=3)
    out, err = capsys.readouterr()
    assert out == ""  # stdout stays the program's own
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    if not progress:
        assert lines == []
        return
    assert len(lines) == 3 and all(LINE.fullmatch(line) for line in lines), lines
    assert [int(LINE.fullmatch(line).group(1)) for line in lines] == [1, 2, 3]
    assert "tok/s" in lines[-1] and "tok/s" not in lines[0]
