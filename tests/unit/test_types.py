"""Every pack/unpack pair of a group's journey keeps each field in its own place.

A scored group travels packed: the policy's ``PackedGroups`` -> ``PackedGroup`` -> the
reference's ``Groups`` of ``PackedPairs`` -> ``EpisodeBatch.of_group`` -> ``Groups`` (to the
buffer, in a ``Sample``, in a rollout worker's ``MadeGroups``) -> ``Episode`` in the trainer.
Each test here fills every field with values no other field holds (behaviour logprobs in
(-2, -1], reference logprobs in (-4, -3], rewards >= 10, advantages <= -20, versions >= 30,
...), so a swap or a mix-up of two fields, or of two episodes, fails an exact comparison
instead of passing because both held the same number. Where a form crosses a process, it is
checked after a trip through Monarch's message pickler too.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import pytest
import torch
from monarch._src.actor import pickle as monarch_pickle

import forge.controller  # noqa: F401  (installs the fast tensor path, as in every forge process)
from apps.grpo.group_orders import MadeGroup, MadeGroups
from forge.actors.policy import PackedGroups, PackedTurns, Policy
from forge.actors.reference_model import PackedPairs, ReferenceModel, ResponseGroup
from forge.actors.replay_buffer import Sample
from forge.envs import Trajectory
from forge.types import (
    Completion,
    Episode,
    EpisodeBatch,
    Group,
    Groups,
    PackedGroup,
    Prompt,
    SFTBatch,
    SFTExample,
    TurnResult,
)


def _wire(obj: Any) -> Any:
    """``obj`` after a trip through Monarch's message pickler."""
    sent = io.BytesIO()
    monarch_pickle.torch_dump(obj, sent)
    return monarch_pickle.torch_loads(sent.getvalue())


def _same(got: Any, want: Any, where: str = "") -> None:
    """Deep equality of dataclasses, lists and tensors (dtype and values exactly)."""
    if dataclasses.is_dataclass(want):
        assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
        for f in dataclasses.fields(want):
            _same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: not a tensor: {got!r}"
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: {got.tolist()} != {want.tolist()}"
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _episode(i: int, group: str, n: int) -> Episode:
    """Episode ``i`` of ``n`` response tokens; every field (and every episode) its own values."""
    k = torch.arange(n, dtype=torch.float32)
    return Episode(
        group_id=group,
        prompt_ids=torch.arange(100 + 10 * i, 100 + 10 * i + 2 + i % 3),
        response_ids=torch.arange(500 + 10 * i, 500 + 10 * i + n),
        behaviour_logprobs=-1.0 - 0.01 * (10 * i + k),
        ref_logprobs=-3.0 - 0.01 * (10 * i + k),
        reward=10.0 + i,
        advantage=-20.0 - i,
        policy_version=30 + i,
        loss_mask=(torch.arange(n) + i) % 2 == 0,
        finish_reason="length" if i % 2 else "stop",
    )


def _episodes() -> list[Episode]:
    """Three groups of 3, 2 and 1 episodes, of response lengths 1..4."""
    sizes = {"a": 3, "b": 2, "c": 1}
    return [_episode(i, g, 1 + i % 4) for i, g in enumerate(g for g, n in sizes.items() for _ in range(n))]


def _by_group(episodes: list[Episode]) -> list[list[Episode]]:
    groups: dict[str, list[Episode]] = {}
    for e in episodes:
        groups.setdefault(e.group_id, []).append(e)
    return list(groups.values())


def test_every_field_of_every_episode_survives_pack_unpack_and_the_wire():
    """EpisodeBatch.pack/unpack, alone and after crossing a process, gives each episode back field for field."""
    episodes = _episodes()
    _same(EpisodeBatch.pack(episodes).unpack(), episodes, "unpack")
    _same(_wire(EpisodeBatch.pack(episodes)).unpack(), episodes, "wire")


def test_concat_and_split_are_inverses_that_keep_every_field():
    """EpisodeBatch.concat of groups, split back by the groups' sizes, gives each group back field for field."""
    groups = [EpisodeBatch.pack(g) for g in _by_group(_episodes())]
    joined = EpisodeBatch.concat(groups)
    _same(joined.unpack(), _episodes(), "concat")
    _same(joined.split([len(g) for g in groups]), groups, "split")
    _same([_wire(piece) for piece in joined.split([len(g) for g in groups])], groups, "split, wire")


def test_episode_groups_cross_a_process_as_the_same_groups():
    """Groups.pack -> the wire -> unpack gives the same groups, each field in its place."""
    groups = [EpisodeBatch.pack(g) for g in _by_group(_episodes())]
    _same(_wire(Groups.pack(groups)).unpack(), groups, "groups")


def test_a_sample_from_the_buffer_arrives_with_its_groups_fields():
    """A buffer Sample (its groups packed on the way) arrives with each group's fields in place."""
    groups = [EpisodeBatch.pack(g) for g in _by_group(_episodes())]
    got = _wire(Sample(groups, evicted=4))
    assert got.evicted == 4
    _same(got.groups, groups, "sample")


def test_made_groups_give_each_order_its_own_group_or_error():
    """MadeGroups.pack -> the wire -> unpack: each order its own group (fields in place), error and tries."""
    groups = [EpisodeBatch.pack(g) for g in _by_group(_episodes())]
    outcomes = [
        MadeGroup(groups[0], None, 0),
        MadeGroup(None, "env broke", 3),
        MadeGroup(groups[1], None, 1),
        MadeGroup(groups[2], None, 2),
    ]
    _same(_wire(MadeGroups.pack(outcomes)).unpack(4), outcomes, "made")
    _same(MadeGroups.pack([MadeGroup(None, "x", 5)]).unpack(1), [MadeGroup(None, "x", 5)], "none made")
    with pytest.raises(ValueError, match="answered 3 group orders with 4 outcomes"):
        MadeGroups.pack(outcomes).unpack(3)


def _completions(version: int, lens: list[int], base: int) -> list[Completion]:
    """Completions of one prompt, each with its own tokens, logprobs, text, finish reason and
    token versions (the first token ``version``'s, the rest the next version's)."""
    prompt_ids = torch.arange(base, base + 3)
    return [
        Completion(
            prompt_ids,
            torch.arange(base + 100 + 10 * j, base + 100 + 10 * j + n),
            -1.0 - 1e-4 * torch.arange(base + 10 * j, base + 10 * j + n, dtype=torch.float32),
            f"text {base} {j}",
            version,
            "length" if (j + base // 1000) % 2 else "stop",
            version + (torch.arange(n) >= 1).long(),  # an update landed after the first token
        )
        for j, n in enumerate(lens)
    ]


def _prompt(i: int) -> Prompt:
    return Prompt(f"p{i}", f"{i}{i}=", f"answer {i}", {"i": i})


def test_policy_groups_reach_each_caller_with_their_own_completions():
    """PackedGroups.pack -> the wire -> Policy.unpack_groups: each prompt its own completions, field for field."""
    prompts = [_prompt(0), _prompt(1)]
    outputs = [_completions(7, [2, 1, 3], 1000), _completions(7, [1, 4, 2], 2000)]
    got = Policy.unpack_groups(_wire(PackedGroups.pack(prompts, outputs, version=7)), 2)
    for group, prompt, want in zip(got, prompts, outputs, strict=True):
        assert group.prompt == prompt and group.policy_version == 7 and len(group) == 3
        _same(group.completions, want, prompt.prompt_id)
    with pytest.raises(ValueError, match="returned 2 groups for 3 prompts"):
        Policy.unpack_groups(PackedGroups.pack(prompts, outputs, version=7), 3)


def test_a_plain_group_packs_into_its_own_fields():
    """PackedGroup.of(Group) and back to completions keeps each completion's fields and versions
    (one without token versions gets its own version on every token); the group's is the oldest."""
    completions = _completions(9, [2, 3, 1], 3000)
    completions[1].policy_version, completions[1].token_versions = 8, None
    packed = _wire(PackedGroup.of(Group(_prompt(3), completions)))
    assert packed.policy_version == 8 and packed.response_lens == [2, 3, 1]
    completions[1].token_versions = torch.full((3,), 8)
    _same(packed.completions, completions, "completions")


def test_turns_reach_each_caller_with_their_own_tokens_and_logprobs():
    """PackedTurns -> the wire -> Policy.unpack_turns: each request its own turn, field for field."""
    turns = [
        TurnResult(torch.arange(10, 10 + n), -1.0 - 0.1 * torch.arange(n, dtype=torch.float32) - i, f"t{i}", 4, r)
        for i, (n, r) in enumerate([(2, "stop"), (1, "length"), (3, "stop")])
    ]
    packed = PackedTurns(
        lens=[2, 1, 3],
        token_ids=torch.cat([t.token_ids for t in turns]),
        logprobs=torch.cat([t.logprobs for t in turns]),
        texts=[t.text for t in turns],
        finish_reasons=[t.finish_reason for t in turns],
        policy_version=4,
    )
    _same(Policy.unpack_turns(_wire(packed), 3), turns, "turns")


def test_reference_pairs_and_groups_reach_the_model_and_come_back_in_order():
    """PackedPairs and a Groups of them cross to the reference with each pair's prompt and response;
    the flat logprobs split back into each caller's own rows."""
    pairs = [(torch.tensor([1, 2]), torch.tensor([30])), (torch.tensor([4]), torch.tensor([50, 60, 70]))]
    prompts, responses = _wire(ReferenceModel.pack_pairs(pairs)).unpack()
    _same(list(zip(prompts, responses)), pairs, "pairs")
    groups = [
        ResponseGroup(torch.tensor([1, 2]), torch.tensor([30, 40, 41]), [1, 2]),
        ResponseGroup(torch.tensor([6]), torch.tensor([70, 80]), [2]),
    ]
    packed = _wire(ReferenceModel.pack_groups(groups))
    assert isinstance(packed.batch, PackedPairs) and packed.sizes == [2, 1]
    prompts, responses = packed.batch.unpack()
    _same(prompts, [torch.tensor([1, 2]), torch.tensor([1, 2]), torch.tensor([6])], "group prompts")
    _same(responses, [torch.tensor([30]), torch.tensor([40, 41]), torch.tensor([70, 80])], "group responses")
    flat = -torch.arange(1, 6, dtype=torch.float32)  # what a replica answers, row after row
    out = ReferenceModel.split_group_logprobs(_wire((flat, packed.batch.response_lens, packed.sizes)), 2)
    _same(out, [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-4.0, -5.0])], "group logprobs")


def test_a_scored_group_puts_reference_behaviour_rewards_and_advantages_in_their_own_fields():
    """EpisodeBatch.of_group: each completion's behaviour logprobs, the reference's, its reward,
    advantage, version, ids and finish reason reach the trainer's Episode in their own fields."""
    completions = _completions(6, [2, 1, 3], 4000)
    group = PackedGroup.of(Group(_prompt(4), completions))
    ref = -3.0 - 0.01 * torch.arange(6, dtype=torch.float32)
    rewards = torch.tensor([10.0, 11.0, 12.0])
    advantages = torch.tensor([-20.0, -21.0, -22.0])
    want = [
        Episode(
            group_id="g4",
            prompt_ids=c.prompt_ids,
            response_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            ref_logprobs=r,
            reward=float(rewards[j]),
            advantage=float(advantages[j]),
            policy_version=6,
            finish_reason=c.finish_reason,
            token_versions=c.token_versions,
        )
        for j, (c, r) in enumerate(zip(completions, torch.split(ref, [2, 1, 3])))
    ]
    batch = EpisodeBatch.of_group(group, "g4", ref, rewards, advantages)
    _same(batch.unpack(), want, "of_group")
    _same(_wire(Groups.pack([batch])).unpack()[0].unpack(), want, "of_group, wire")
    with pytest.raises(ValueError, match="6 tokens, but 5 reference logprobs, 3 rewards, 3 advantages"):
        EpisodeBatch.of_group(group, "g4", ref[:5], rewards, advantages)


def test_a_trajectory_becomes_an_episode_with_each_field_in_place():
    """Trajectory.to_episode: reference and behaviour logprobs, reward and advantage each in their own field."""
    traj = Trajectory("g/0", "g", torch.tensor([1, 2]))
    traj.add_turn(TurnResult(torch.tensor([11, 12]), torch.tensor([-1.1, -1.2]), "", 5))
    traj.add_observation(torch.tensor([7]), reward=0.25, done=False)
    traj.add_turn(TurnResult(torch.tensor([13]), torch.tensor([-1.3]), "", 4))
    traj.add_observation(torch.tensor([], dtype=torch.long), reward=0.5, done=True)
    ref = torch.tensor([-3.1, -3.2, -3.7, -3.3])
    want = Episode(
        group_id="g",
        prompt_ids=torch.tensor([1, 2]),
        response_ids=torch.tensor([11, 12, 7, 13]),
        behaviour_logprobs=torch.tensor([-1.1, -1.2, 0.0, -1.3]),
        ref_logprobs=ref,
        reward=0.75,
        advantage=-2.0,
        policy_version=4,
        loss_mask=torch.tensor([True, True, False, True]),
        token_versions=torch.tensor([5, 5, -1, 4]),  # each sampled token its turn's version; -1: the env's
    )
    _same(traj.to_episode("g", ref, -2.0), want, "episode")


def test_token_ages_count_each_sampled_token_and_the_episodes_that_span_versions():
    """EpisodeBatch.token_ages at version 10: ages of the sampled tokens only (not an env's -1, not
    masked ones), their max, and the share of episodes whose tokens span versions."""
    episodes = [
        Episode(
            "g",
            torch.tensor([1]),
            torch.tensor([5, 6, 7]),
            torch.zeros(3),
            torch.zeros(3),
            0.0,
            0.0,
            7,
            token_versions=torch.tensor([7, 8, 8]),
        ),
        Episode(
            "g",
            torch.tensor([1]),
            torch.tensor([5, 6, 7]),
            torch.zeros(3),
            torch.zeros(3),
            0.0,
            0.0,
            9,
            loss_mask=torch.tensor([True, False, True]),
            token_versions=torch.tensor([9, -1, 9]),
        ),
    ]
    ages = EpisodeBatch.pack(episodes).token_ages(10)
    want = {"token_age_mean": (3 + 2 + 2 + 1 + 1) / 5, "token_age_max": 3.0, "spanning_fraction": 0.5}
    assert ages == pytest.approx(want, rel=1e-6)
    plain = EpisodeBatch.pack([dataclasses.replace(e, token_versions=None, loss_mask=None) for e in episodes])
    assert plain.token_ages(10) == {"token_age_mean": 2.0, "token_age_max": 3.0, "spanning_fraction": 0.0}


def test_sft_examples_cross_with_prompt_and_answer_apart():
    """SFTBatch.pack -> the wire -> unpack gives each example its own prompt and answer."""
    examples = [SFTExample(torch.arange(10 * i, 10 * i + 1 + i), torch.arange(500 + i, 503 + i)) for i in range(3)]
    _same(_wire(SFTBatch.pack(examples)).unpack(), examples, "sft")
