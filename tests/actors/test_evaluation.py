"""``Evaluator``: held-out evaluation as a learner hook. On the FakeEngine: its metrics every K steps with the right
values, request ids apart from the producers', a raising reward, cancellation, a paused engine, an overlapped
publication; on the session's vLLM engine: greedy decoding is accepted and repeatable."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl import Evaluator, InvalidGroupError, PauseMode, Prompt, SamplingConfig, SyncConfig
from asyncrl.actors.evaluation import GREEDY_TEMPERATURE, greedy
from asyncrl.engines.fake import FakeEngine
from asyncrl.groups import RewardGroups
from tests.support.pipelines import config, make_pipeline, prompts


class Recorder:
    """A monitor keeping every step's metrics."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def log(self, step, metrics) -> None:
        self.rows[step] = dict(metrics)

    def close(self) -> None:
        pass


class RecordingEngine(FakeEngine):
    """A FakeEngine that records each request's id and sampling config."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: list[tuple[str, SamplingConfig]] = []

    async def generate(self, prompt_ids, params, request_id, n=None):
        self.calls.append((request_id, params))
        return await super().generate(prompt_ids, params, request_id, n)


HELD_OUT = [Prompt(f"h{i}", (i + 1,), answer=i) for i in range(10)]


def even_answer(prompt, sample) -> float:
    return 1.0 if prompt.answer % 2 == 0 else 0.0  # 5 of the 10 held-out prompts: accuracy 0.5


async def test_metrics_every_k_steps_with_the_right_values():
    engine = RecordingEngine()
    pipe = make_pipeline(engine, prompts(1000), config())
    pipe.learner.monitor = monitor = Recorder()
    evaluator = Evaluator(engine, HELD_OUT, RewardGroups(even_answer), every=2, config=pipe.config.producer)
    pipe.learner.hooks.append(evaluator)
    await pipe.run(steps=5)
    assert [s for s, row in sorted(monitor.rows.items()) if "eval/accuracy" in row] == [2, 4]
    row = monitor.rows[4]
    assert row["eval/accuracy"] == row["eval/reward_mean"] == 0.5
    assert row["eval/samples"] == 10 and row["eval/dropped"] == 0 and row["eval/s"] >= 0
    assert row["eval/version"] == 4  # measured after step 4's publication landed
    assert evaluator.rounds == 2 and len(evaluator.groups) == 10
    evals = [(rid, p) for rid, p in engine.calls if rid.startswith("asyncrl-eval-")]
    assert len(evals) == 20 and len({rid for rid, _ in evals}) == 20, "ids unique across evaluations"
    assert len({rid.split("-")[3] for rid, _ in evals}) == 2  # the round is in the id (after the evaluator's)
    assert all(p.n == 1 and p.temperature == GREEDY_TEMPERATURE and p.max_tokens == 4 for _, p in evals)
    assert all(rid.startswith(("asyncrl-eval-", "p")) for rid, _ in engine.calls)  # producers': the prompts' ids


async def test_sampling_is_configurable_and_evaluate_works_by_hand():
    engine = RecordingEngine()
    sampling = SamplingConfig(n=3, max_tokens=2, temperature=0.7)
    result = await Evaluator(engine, HELD_OUT[:4], RewardGroups(even_answer), every=0, sampling=sampling).evaluate()
    assert result["eval/samples"] == 12 and result["eval/accuracy"] == 0.5
    assert {p for _, p in engine.calls} == {sampling}
    assert greedy(SamplingConfig(max_tokens=9, stop_token_ids=(3,))) == SamplingConfig(
        n=1, max_tokens=9, temperature=GREEDY_TEMPERATURE, stop_token_ids=(3,))


@pytest.mark.parametrize("sync_rewards", ["thread", "inline"])
async def test_a_raising_reward_stops_the_run_naming_the_prompt_and_step(sync_rewards):
    def broken(prompt, sample) -> float:
        if prompt.prompt_id == "h3":
            raise ValueError("no answer key for h3")
        return 1.0

    engine = FakeEngine()
    pipe = make_pipeline(engine, prompts(1000), config())
    producer_config = pipe.config.producer.__class__(sampling=pipe.config.producer.sampling, sync_rewards=sync_rewards)
    pipe.learner.hooks.append(Evaluator(engine, HELD_OUT, RewardGroups(broken), every=2, config=producer_config))
    with pytest.raises(InvalidGroupError, match=r"evaluation after step 2: .*h3.*reward_error.*no answer key for h3"):
        await pipe.run(steps=4)
    assert engine.closed, "the pipeline shut down"


async def test_cancellation_propagates_and_leaves_no_request_running():
    entered, forever = asyncio.Event(), asyncio.Event()

    async def hanging(prompt, sample) -> float:
        entered.set()
        await forever.wait()
        return 1.0

    engine = FakeEngine(token_delay_s=0.001)
    pipe = make_pipeline(engine, prompts(1000), config())
    pipe.learner.hooks.append(Evaluator(engine, HELD_OUT, RewardGroups(hanging), every=1))
    run = asyncio.create_task(pipe.run(steps=3))
    await asyncio.wait_for(entered.wait(), 10)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert pipe.learner.step == 1 and engine.closed
    # Straight on the evaluator too: the caller's cancellation is raised, not swallowed into an error or a result.
    evaluator = Evaluator(FakeEngine(), HELD_OUT, RewardGroups(hanging), every=1)
    entered.clear()
    task = asyncio.create_task(evaluator.evaluate())
    await asyncio.wait_for(entered.wait(), 10)  # inside its reward: cancelled mid-evaluation
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_waits_out_a_pause_instead_of_deadlocking():
    engine = FakeEngine()
    await engine.pause(PauseMode.KEEP, clear_cache=False)
    evaluation = asyncio.create_task(Evaluator(engine, HELD_OUT, RewardGroups(even_answer), every=1).evaluate())

    async def all_requests_waiting() -> None:
        while engine.requests < len(HELD_OUT):  # counted on arrival, before the paused engine holds them
            await asyncio.sleep(0)

    await asyncio.wait_for(all_requests_waiting(), 10)
    assert not evaluation.done(), "requests wait in the paused engine"
    await engine.resume()
    assert (await asyncio.wait_for(evaluation, 10))["eval/samples"] == 10


@pytest.mark.parametrize("mode", [PauseMode.KEEP, PauseMode.ABORT, PauseMode.WAIT])
async def test_every_step_beside_an_overlapped_publication(mode):
    engine = FakeEngine(token_delay_s=0.0005)
    cfg = config()
    cfg = cfg.__class__(producer=cfg.producer, queue=cfg.queue, num_producers=cfg.num_producers,
                        learner=cfg.learner.__class__(batch_groups=2, sync=SyncConfig(overlap=True, mode=mode)))
    pipe = make_pipeline(engine, prompts(1000), cfg)
    pipe.learner.monitor = monitor = Recorder()
    pipe.learner.hooks.append(Evaluator(engine, HELD_OUT, RewardGroups(even_answer), every=1, config=cfg.producer))
    stats = await asyncio.wait_for(pipe.run(steps=4), 60)
    assert stats.steps == 4 and stats.unaccounted == 0
    assert all(monitor.rows[s]["eval/samples"] + monitor.rows[s]["eval/dropped"] == 10 for s in range(1, 5))


def test_refuses_what_cannot_evaluate():
    engine = FakeEngine()
    with pytest.raises(ValueError, match="at least one prompt"):
        Evaluator(engine, [], RewardGroups(even_answer), every=1)
    with pytest.raises(TypeError, match="needs a GroupMaker"):
        Evaluator(engine, HELD_OUT, even_answer, every=1)  # a reward function is not a maker
    with pytest.raises(ValueError, match="every >= 0"):
        Evaluator(engine, HELD_OUT, RewardGroups(even_answer), every=-1)


# ------------------------------------------------------------------------------------------ the real engine


@pytest.mark.vllm
@pytest.mark.asyncio(loop_scope="session")
async def test_greedy_on_vllm_is_accepted_and_repeatable(vllm_engine, tokenizer):
    from asyncrl.testing.tasks import arithmetic

    _, held_out = arithmetic.split(0, 16)
    items = [Prompt(f"h{i}", tuple(tokenizer(p.prompt).input_ids), p.prompt, p.answer) for i, p in enumerate(held_out)]
    evaluator = Evaluator(vllm_engine, items, RewardGroups(lambda p, s: arithmetic.reward(s.text, p.answer)), every=1,
                          sampling=greedy(SamplingConfig(max_tokens=6)))
    first = await evaluator.evaluate()
    texts = {g.prompt.prompt_id: g.rollouts[0].sample.text for g in evaluator.groups}
    second = await evaluator.evaluate()
    assert first["eval/samples"] == second["eval/samples"] == 16
    assert first["eval/accuracy"] == second["eval/accuracy"]
    assert {g.prompt.prompt_id: g.rollouts[0].sample.text for g in evaluator.groups} == texts, "greedy: the same"
