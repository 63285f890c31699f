"""The ``Dataset`` actor on records from files: a resumed run's dataset, sought to the position
the checkpoint recorded, hands out the prompts the first run would have handed out next."""

from __future__ import annotations

import json
from pathlib import Path


async def test_a_sought_dataset_continues_the_formatted_epochs_where_the_first_left_off(tmp_path: Path) -> None:
    """Five records, seed 3, a prompt template: a fresh actor sought to 4 hands out what the first
    handed out as its 5th to 9th prompts (across the epoch's end, reshuffled), formatted alike."""
    from monarch.actor import this_proc

    from forge.actors.dataset import Dataset, DatasetConfig
    from forge.data import DataSource

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(5)))
    config = DatasetConfig(source="dataset", records=DataSource(path=str(path)), prompt_template="Q: {text}", seed=3)
    first = this_proc().spawn("dataset_files_first", Dataset, config)
    second = this_proc().spawn("dataset_files_second", Dataset, config)
    try:
        await first.setup.call_one()
        await second.setup.call_one()
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
    finally:
        await first.stop()
        await second.stop()


async def test_seek_restarts_a_stream_that_is_read_up_to_the_position() -> None:
    """The toy stream has no O(1) seek: a dataset that already handed out prompts, sought to 3,
    restarts its stream and reads it up to there, so it hands out the first one's 4th and 5th."""
    from monarch.actor import this_proc

    from forge.actors.dataset import Dataset, DatasetConfig

    config = DatasetConfig(source="toy", seed=5, prompt_template="Q: {text}")
    first = this_proc().spawn("dataset_toy_first", Dataset, config)
    second = this_proc().spawn("dataset_toy_second", Dataset, config)
    try:
        await first.setup.call_one()
        await second.setup.call_one()
        prompts = await first.sample_many.call_one(5)
        await second.sample_many.call_one(2)
        await second.seek.call_one(3)
        assert [(p.prompt_id, p.text) for p in await second.sample_many.call_one(2)] == [
            (p.prompt_id, p.text) for p in prompts[3:]
        ]
    finally:
        await first.stop()
        await second.stop()
