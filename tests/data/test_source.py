"""PromptSource over sequences: epochs, seeded shuffles, and resumes from a cursor that continue exactly where an
unbroken run was (across an epoch boundary too); streams read once refuse what they cannot replay."""

from __future__ import annotations

import pytest

from asyncrl import ConfigError, Prompt
from asyncrl.data import PromptSource

ITEMS = [Prompt(f"p{i}", (i + 1,)) for i in range(5)]


async def drain(source: PromptSource, limit: int = 1000) -> list[tuple[int, str]]:
    out = []
    while len(out) < limit and (item := await source.next()) is not None:
        out.append((item[0], item[1].prompt_id))
    return out


async def test_a_list_is_handed_out_once_by_default_then_the_source_is_exhausted() -> None:
    source = PromptSource(ITEMS)
    assert await drain(source) == [(i, f"p{i}") for i in range(5)]
    assert source.exhausted and source.cursor == 5 and source.total == 5


async def test_epochs_repeat_the_items_in_order_without_a_seed() -> None:
    source = PromptSource(ITEMS, epochs=3)
    got = await drain(source)
    assert [pid for _, pid in got] == [p.prompt_id for p in ITEMS] * 3
    assert [i for i, _ in got] == list(range(15))  # stream indices stay unique: group ids are prompt_id#index
    assert source.epoch == 3 and source.exhausted


async def test_each_epoch_is_its_own_seeded_permutation() -> None:
    got = [pid for _, pid in await drain(PromptSource(ITEMS, epochs=4, shuffle_seed=7))]
    epochs = [got[i:i + 5] for i in range(0, 20, 5)]
    assert all(sorted(e) == sorted(p.prompt_id for p in ITEMS) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "every epoch in the same order"
    again = [pid for _, pid in await drain(PromptSource(ITEMS, epochs=4, shuffle_seed=7))]
    assert again == got
    other = [pid for _, pid in await drain(PromptSource(ITEMS, epochs=4, shuffle_seed=8))]
    assert other != got


@pytest.mark.parametrize("cursor", [0, 3, 5, 7, 12])  # 5: exactly at an epoch boundary; 7, 12: inside later ones
async def test_a_resumed_source_continues_an_unbroken_runs_order(cursor: int) -> None:
    fresh = await drain(PromptSource(ITEMS, epochs=3, shuffle_seed=1))
    resumed = PromptSource(ITEMS, start=cursor, epochs=3, shuffle_seed=1)
    assert resumed.epoch == cursor // 5
    assert await drain(resumed) == fresh[cursor:]


@pytest.mark.parametrize("stream", [False, True], ids=["list", "iterator"])
async def test_seek_positions_a_fresh_source_as_start_would_and_refuses_a_used_one(stream: bool) -> None:
    """What resume_pipeline does with a source the caller built with its epochs and seed."""
    def make(**kw):  # type: ignore[no-untyped-def]
        return PromptSource(iter(ITEMS), **kw) if stream else PromptSource(ITEMS, epochs=3, shuffle_seed=1, **kw)

    sought = make()
    sought.seek(3)
    assert await drain(sought) == await drain(make(start=3))
    used = make()
    await used.next()
    with pytest.raises(ConfigError, match=r"seek\(2\) on a source already at 1"):
        used.seek(2)


async def test_without_end_epochs_keep_coming() -> None:
    source = PromptSource(ITEMS, epochs=None, shuffle_seed=0)
    got = await drain(source, limit=23)
    assert len(got) == 23 and source.epoch == 4 and not source.exhausted and source.total is None
    resumed = PromptSource(ITEMS, start=1_000_003, epochs=None, shuffle_seed=0)  # no replay to get there
    index, _ = await resumed.next()
    assert index == 1_000_003 and resumed.epoch == 200_000


async def test_a_resume_past_the_end_is_exhausted() -> None:
    source = PromptSource(ITEMS, start=10, epochs=2)
    assert await source.next() is None and source.exhausted


@pytest.mark.parametrize("kwargs, named", [({"epochs": 2}, "epochs=2"), ({"epochs": None}, "epochs=None"),
                                           ({"shuffle_seed": 0}, "shuffle_seed")])
def test_a_stream_read_once_refuses_epochs_and_shuffles(kwargs, named: str) -> None:
    with pytest.raises(ConfigError, match=named) as err:
        PromptSource(iter(ITEMS), **kwargs)
    assert "read once" in str(err.value) and "list(items)" in str(err.value)

    async def stream():
        for p in ITEMS:
            yield p

    with pytest.raises(ValueError, match=named):
        PromptSource(stream(), **kwargs)


async def test_streams_still_work_once_with_a_cursor() -> None:
    assert await drain(PromptSource(iter(ITEMS), start=2)) == [(i, f"p{i}") for i in range(2, 5)]

    async def stream():
        for p in ITEMS:
            yield p

    assert await drain(PromptSource(stream(), start=4)) == [(4, "p4")]


def test_bad_epochs_and_start_are_refused() -> None:
    with pytest.raises(ConfigError, match="PromptSource.epochs"):
        PromptSource(ITEMS, epochs=0)
    with pytest.raises(ConfigError, match="PromptSource.start"):
        PromptSource(ITEMS, start=-1)


@pytest.mark.parametrize("synchronous", [False, True])
async def test_a_run_whose_prompts_run_out_says_so_and_names_epochs(synchronous: bool) -> None:
    from asyncrl import NoProgressError
    from asyncrl.engines.fake import FakeEngine
    from tests.support.pipelines import config, make_pipeline, prompts

    pipe = make_pipeline(FakeEngine(), PromptSource(prompts(4)), config(batch=2))
    with pytest.raises(NoProgressError, match=r"ran out.*epochs="):
        await (pipe.run_synchronous if synchronous else pipe.run)(5)
    repeated = make_pipeline(FakeEngine(), PromptSource(prompts(4), epochs=None), config(batch=2))
    assert (await (repeated.run_synchronous if synchronous else repeated.run)(5)).steps == 5
