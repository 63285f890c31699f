"""ReplayBuffer: groups stay together, stale groups are evicted by policy age, FIFO sampling."""

from __future__ import annotations

import pytest
import torch

from forge.actors.replay_buffer import GroupBuffer, ReplayBuffer, Sample, group_version
from forge.types import Episode, EpisodeBatch, Groups


def _episodes(group_id: str, version: int, size: int = 3) -> list[Episode]:
    return [
        Episode(
            group_id=group_id,
            prompt_ids=torch.tensor([4, 5]),
            response_ids=torch.tensor([6]),
            behaviour_logprobs=torch.tensor([-1.0]),
            ref_logprobs=torch.tensor([-1.0]),
            reward=float(i),
            advantage=0.0,
            policy_version=version,
        )
        for i in range(size)
    ]


def _group(group_id: str, version: int, size: int = 3) -> EpisodeBatch:
    return EpisodeBatch.pack(_episodes(group_id, version, size))


def test_sample_returns_whole_groups_oldest_first():
    """A sample is a list of complete groups, in the order they were added."""
    buf = GroupBuffer(max_policy_age=1)
    for i in range(3):
        buf.add(_group(f"g{i}", version=0))
    batch = buf.sample(2, policy_version=0)
    assert [g.group_ids[0] for g in batch] == ["g0", "g1"]
    assert all(len(g) == 3 and set(g.group_ids) == {g.group_ids[0]} for g in batch)
    assert len(buf) == 1


def test_sample_returns_none_when_too_few_groups():
    """Fewer groups than asked for gives None and keeps the groups."""
    buf = GroupBuffer(max_policy_age=1)
    buf.add(_group("g0", version=0))
    assert buf.sample(2, policy_version=0) is None
    assert len(buf) == 1


def test_groups_older_than_max_policy_age_are_evicted():
    """At version v, a group of version g survives only if v - g <= max_policy_age."""
    buf = GroupBuffer(max_policy_age=1)
    buf.add(_group("old", version=3))
    buf.add(_group("edge", version=4))
    buf.add(_group("new", version=5))
    assert buf.evict(policy_version=5) == 1
    batch = buf.sample(2, policy_version=5)
    assert [g.group_ids[0] for g in batch] == ["edge", "new"]
    assert buf.snapshot().evicted == 1


def test_max_policy_age_zero_is_strictly_on_policy():
    """With max_policy_age=0 only groups of the current version are sampled."""
    buf = GroupBuffer(max_policy_age=0)
    buf.add(_group("stale", version=1))
    buf.add(_group("fresh", version=2))
    assert [g.group_ids[0] for g in buf.sample(1, policy_version=2)] == ["fresh"]


def test_group_version_is_its_oldest_episode():
    """A group with mixed versions is as old as its oldest episode."""
    episodes = _episodes("g", version=5)
    episodes[1].policy_version = 3
    group = EpisodeBatch.pack(episodes)
    assert group_version(group) == 3
    buf = GroupBuffer(max_policy_age=1)
    buf.add(group)
    assert buf.evict(policy_version=5) == 1


def test_capacity_drops_the_oldest_group():
    """Adding to a full buffer drops its oldest group."""
    buf = GroupBuffer(max_policy_age=10, capacity=2)
    for i in range(3):
        buf.add(_group(f"g{i}", version=0))
    assert [g.group_ids[0] for g in buf.sample(2, policy_version=0)] == ["g1", "g2"]


@pytest.mark.parametrize(
    "group, match",
    [
        (_episodes("a", 0), "must be an EpisodeBatch"),
        (EpisodeBatch.pack(_episodes("a", 0)[:1] + _episodes("b", 0)[:1]), "share one group_id"),
    ],
)
def test_add_rejects_malformed_groups(group, match):
    """Unpacked episodes and groups mixing group_ids are refused."""
    with pytest.raises((TypeError, ValueError), match=match):
        GroupBuffer(max_policy_age=1).add(group)


@pytest.mark.parametrize("age", [-1, 1.5, True])
def test_bad_max_policy_age_is_refused(age):
    """max_policy_age must be an integer >= 0."""
    with pytest.raises(ValueError, match="max_policy_age"):
        GroupBuffer(max_policy_age=age)


def test_episode_batch_round_trips():
    """EpisodeBatch.pack/unpack/concat keep every field of every episode."""
    episodes = _episodes("a", 2) + _episodes("b", 3, size=2)
    episodes[1].response_ids = torch.tensor([7, 8, 9])
    episodes[1].behaviour_logprobs = episodes[1].ref_logprobs = torch.tensor([-1.0, -2.0, -3.0])
    batch = EpisodeBatch.concat([EpisodeBatch.pack(episodes[:3]), EpisodeBatch.pack(episodes[3:])])
    for got, want in zip(batch.unpack(), episodes, strict=True):
        assert got.group_id == want.group_id and got.policy_version == want.policy_version
        assert torch.equal(got.response_ids, want.response_ids)
        assert torch.equal(got.behaviour_logprobs, want.behaviour_logprobs)
        assert got.reward == want.reward


def _fields(batch: EpisodeBatch) -> dict:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}


def test_groups_packed_into_one_batch_split_back_exactly():
    """Groups.pack/unpack (one batch for many groups) gives back every group's fields;
    each group's tensors, sent on alone, carry their own elements, not the packed batch's."""
    a = EpisodeBatch.pack(_episodes("a", 2))
    b_episodes = _episodes("b", 3, size=2)
    b_episodes[0].response_ids = torch.tensor([7, 8, 9])
    b_episodes[0].behaviour_logprobs = b_episodes[0].ref_logprobs = torch.tensor([-1.0, -2.0, -3.0])
    b_episodes[0].loss_mask = torch.tensor([True, False, True])
    b_episodes[0].finish_reason = "length"
    b = EpisodeBatch.pack(b_episodes)
    c = EpisodeBatch.pack(_episodes("c", 4, size=1))
    packed = Groups.pack([a, b, c])
    assert packed.sizes == [3, 2, 1] and len(packed.batch) == 6
    got = packed.unpack()
    assert [_fields(g) for g in got[1:2]] == [_fields(b)]
    # A group packed beside one with a loss mask comes back with an all-true mask: the same training.
    assert _fields(got[2]) == {**_fields(c), "loss_mask": [True]}
    import io

    from monarch._src.actor import pickle as monarch_pickle

    import forge.controller  # noqa: F401  (installs the fast tensor path)

    sent = io.BytesIO()
    monarch_pickle.torch_dump(got[0].response_ids, sent)
    own = got[0].response_ids.numel() * 8
    assert packed.batch.response_ids.numel() * 8 > own and own < len(sent.getvalue()) < own + 1_000
    with pytest.raises(ValueError, match="add up"):
        packed.batch.split([3, 2])


async def test_actor_takes_packed_groups_and_its_samples_cross_packed():
    """add_many takes Groups; a Sample crossing a process carries its groups as one
    Groups and arrives as the same list of groups."""
    import pickle

    from monarch.actor import this_proc

    groups = [_group(f"g{i}", version=0, size=i + 1) for i in range(3)]
    sample = Sample(groups, evicted=1)
    assert isinstance(sample.__getstate__()["groups"], Groups)
    back = pickle.loads(pickle.dumps(sample))
    assert [_fields(g) for g in back.groups] == [_fields(g) for g in groups] and back.evicted == 1
    actor = this_proc().spawn("buffer_packed_test", ReplayBuffer, 0)
    try:
        await actor.setup.call_one()
        assert await actor.add_many.call_one(Groups.pack(groups)) == [True, True, True]
        got = await actor.sample.call_one(3, 0)
        assert [g.group_ids for g in got.groups] == [g.group_ids for g in groups]
    finally:
        await actor.stop()


async def test_actor_reports_evictions_with_each_sample():
    """The actor's sample() says how many stale groups it evicted, even when it returns None."""
    from monarch.actor import this_proc

    actor = this_proc().spawn("buffer_test", ReplayBuffer, 0)
    try:
        await actor.setup.call_one()
        assert await actor.add.call_one(_group("stale", version=0)) == 1
        await actor.add.call_one(_group("fresh", version=1))
        sample = await actor.sample.call_one(2, 1)
        assert isinstance(sample, Sample) and sample.groups is None and sample.evicted == 1
        sample = await actor.sample.call_one(1, 1)
        assert sample.evicted == 0 and sample.groups[0].group_ids[0] == "fresh"
        assert (await actor.stats.call_one()).sampled == 1
    finally:
        await actor.stop()


def test_a_group_id_added_twice_is_refused_and_counted_as_a_duplicate():
    """A second group with a group_id already added is not stored, so it can never train twice."""
    buf = GroupBuffer(max_policy_age=1)
    assert buf.add(_group("g0", version=0)) is True
    assert buf.sample(1, policy_version=0) is not None
    assert buf.add(_group("g0", version=0)) is False  # even after the first one was trained
    assert len(buf) == 0
    assert buf.snapshot().duplicates == 1 and buf.snapshot().added == 1


def test_every_group_added_is_sampled_dropped_or_held():
    """added == sampled + dropped_stale + dropped_full + size after adds, evictions and samples."""
    buf = GroupBuffer(max_policy_age=0, capacity=3)
    for i in range(4):  # the 4th add drops the oldest (capacity)
        buf.add(_group(f"g{i}", version=0))
    buf.add(_group("new", version=1))  # full again: drops g1
    assert buf.sample(1, policy_version=1) is not None  # evicts g2, g3 as stale, takes "new"
    stats = buf.snapshot()
    assert (stats.added, stats.sampled, stats.dropped_full, stats.dropped_stale, stats.size) == (5, 1, 2, 2, 0)
    assert stats.evicted == stats.dropped_full + stats.dropped_stale and stats.balanced
