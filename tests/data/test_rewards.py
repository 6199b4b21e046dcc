"""answer_reward (exact, else GSM8K's last number) and load_reward: a "module:function" named on a command line,
loaded as the library's RewardFn, with an error for every way the name can be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl import FinishReason, Prompt, Sample, VersionSpan
from asyncrl.data import answer_reward, load_reward, reference_answer

USER_MODULE = '''
VALUE = 3


def reward(prompt, sample):
    return 1.0 if sample.text.strip() == prompt.answer else 0.0


def one_arg(sample):
    return 0.0


class Scorer:
    @staticmethod
    def score(prompt, sample, scale=1.0):
        return scale
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_rewards_for_test.py").write_text(USER_MODULE)
    (tmp_path / "broken_rewards_for_test.py").write_text("import no_such_package_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_for_test"


def test_answer_reward_exact_then_last_number() -> None:
    assert answer_reward(" 42 ", "42") == 1.0
    assert answer_reward("so the total is 1,234", "steps... #### 1234") == 1.0
    assert answer_reward("1234 then 5", "1234") == 0.0
    assert answer_reward("blue", "Blue") == 0.0
    assert reference_answer("a #### b #### 7 ") == "7" and reference_answer(" 7 ") == "7"


def test_load_reward_returns_a_library_reward_fn(user_module: str) -> None:
    fn = load_reward(f"{user_module}:reward")
    sample = Sample((1,), (0.0,), FinishReason.STOP, (VersionSpan(0, 0, 1),), text=" 7")
    assert fn(Prompt("p", (1,), "3+4=", "7"), sample) == 1.0
    assert load_reward(f"{user_module}:Scorer.score")(None, None) == 1.0  # a dotted path after the colon


@pytest.mark.parametrize("spec, message", [
    ("user_rewards_for_test", r"expected 'package.module:function'"),
    (":reward", r"expected 'package.module:function'"),
    ("user_rewards_for_test:", r"expected 'package.module:function'"),
    ("no_such_module_for_test:reward", r"cannot import module 'no_such_module_for_test'"),
    ("broken_rewards_for_test:reward", r"cannot import module 'broken_rewards_for_test': .*no_such_package"),
    ("user_rewards_for_test:missing", r"module 'user_rewards_for_test' has no attribute 'missing'"),
    ("user_rewards_for_test:VALUE", r"'VALUE' is a int, not callable"),
    ("user_rewards_for_test:one_arg", r"'one_arg' must take two arguments, \(prompt, sample\)"),
])
def test_load_reward_says_what_is_wrong(user_module: str, spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_reward(spec)
