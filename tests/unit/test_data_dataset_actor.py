"""The ``Dataset`` actor on records from files: a resumed run's dataset, sought to the position
the checkpoint recorded, hands out the prompts the first run would have handed out next."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from forge.actors.dataset import Dataset, DatasetConfig


@asynccontextmanager
async def two_datasets(name: str, config: DatasetConfig) -> AsyncIterator[tuple]:
    """Two in-process ``Dataset`` actors of one config, set up: a run's and its resumed run's."""
    from monarch.actor import this_proc

    first = this_proc().spawn(f"{name}_first", Dataset, config)
    second = this_proc().spawn(f"{name}_second", Dataset, config)
    try:
        await first.setup.call_one()
        await second.setup.call_one()
        yield first, second
    finally:
        await first.stop()
        await second.stop()


async def test_a_sought_dataset_continues_the_formatted_epochs_where_the_first_left_off(tmp_path: Path) -> None:
    """Five records, seed 3, a prompt template: a fresh actor sought to 4 hands out what the first
    handed out as its 5th to 9th prompts (across the epoch's end, reshuffled), formatted alike."""
    from forge.data import DataSource

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(5)))
    config = DatasetConfig(source="dataset", records=DataSource(path=str(path)), prompt_template="Q: {text}", seed=3)
    async with two_datasets("dataset_files", config) as (first, second):
        prompts = await first.sample_many.call_one(9)
        assert sorted(p.text for p in prompts[:5]) == [f"Q: {i}+{i}=" for i in range(5)]  # one epoch: each once
        assert [p.prompt_id for p in prompts[:4]] != [p.prompt_id for p in prompts[5:]]  # the next one reshuffled
        await second.sample_many.call_one(2)  # a stream that moved on is restarted by seek
        await second.seek.call_one(4)
        assert await second.position.call_one() == 4
        resumed = await second.sample_many.call_one(5)
        assert [(p.prompt_id, p.text, p.answer) for p in resumed] == [
            (p.prompt_id, p.text, p.answer) for p in prompts[4:]
        ]
        assert await second.position.call_one() == 9


async def test_seek_restarts_a_stream_that_is_read_up_to_the_position() -> None:
    """The toy stream has no O(1) seek: a dataset that already handed out prompts, sought to 3,
    restarts its stream and reads it up to there, so it hands out the first one's 4th and 5th."""
    config = DatasetConfig(source="toy", seed=5, prompt_template="Q: {text}")
    async with two_datasets("dataset_toy", config) as (first, second):
        prompts = await first.sample_many.call_one(5)
        await second.sample_many.call_one(2)
        await second.seek.call_one(3)
        assert [(p.prompt_id, p.text) for p in await second.sample_many.call_one(2)] == [
            (p.prompt_id, p.text) for p in prompts[3:]
        ]


async def test_dataset_seek_continues_the_stream_where_a_position_left_it() -> None:
    """A fresh dataset sought to position 3 hands out the 4th prompt next, as the first did."""
    async with two_datasets("dataset_plain", DatasetConfig(source="toy", seed=7)) as (first, second):
        prompts = await first.sample_many.call_one(5)
        assert await first.position.call_one() == 5
        await second.seek.call_one(3)
        assert await second.position.call_one() == 3
        assert [p.prompt_id for p in await second.sample_many.call_one(2)] == [p.prompt_id for p in prompts[3:]]
