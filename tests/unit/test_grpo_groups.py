"""The group makers' frame (``apps.grpo.groups``): which maker a run gets, and the retries of a
group whose replica died. The makers' own work is tested on real role services
(``test_envs_service.py``, ``test_rollout_scale.py``, ``test_multiturn.py``)."""

from __future__ import annotations

import pytest
import torch

from apps.common.launch import Roles
from apps.common.roles import RoleFailed
from apps.grpo import groups
from apps.grpo.groups import GroupSettings, SingleTurnGroups, group_maker, make_with_retries
from apps.grpo.multiturn import MultiTurnGroups
from apps.grpo.rollouts import Rollouts
from forge.controller import ReplicaFailed
from forge.types import Episode, EpisodeBatch, Prompt

PROMPT = Prompt("p0", "1 + 1", "2")


def _group(group_id: str) -> EpisodeBatch:
    ids = torch.tensor([1, 2])
    episode = Episode(
        group_id=group_id,
        prompt_ids=ids,
        response_ids=ids,
        behaviour_logprobs=torch.zeros(2),
        ref_logprobs=torch.zeros(2),
        reward=1.0,
        advantage=0.0,
        policy_version=0,
    )
    return EpisodeBatch.pack([episode])


class Flaky:
    """Fails its first ``failures`` calls with ``error``, then makes the group."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0

    async def __call__(self, prompt: Prompt, group_id: str) -> EpisodeBatch:
        self.calls += 1
        if self.calls <= self.failures:
            raise RoleFailed("policy", self.error)
        return _group(group_id)


async def test_a_group_whose_replica_died_is_made_again_and_the_tries_are_counted() -> None:
    make = Flaky(2, ReplicaFailed("policy replica 0 died"))
    group, regenerated = await make_with_retries(make, PROMPT, "g")
    assert (make.calls, regenerated, group.group_ids) == (3, 2, ["g"])


async def test_a_roles_own_failure_is_raised_at_once_and_a_dying_replica_after_the_last_try(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(groups, "MAX_GROUP_ATTEMPTS", 3)  # each try waits longer for a restart: keep it short
    own = Flaky(1, ValueError("bad reward function"))
    with pytest.raises(RoleFailed, match="bad reward function"):
        await make_with_retries(own, PROMPT, "g")
    assert own.calls == 1
    dying = Flaky(3, ReplicaFailed("policy replica 0 died"))
    with pytest.raises(RoleFailed, match="policy replica 0 died"):
        await make_with_retries(dying, PROMPT, "g")
    assert dying.calls == 3


def test_a_run_gets_the_maker_of_its_kind_and_rollouts_need_a_maker_or_workers() -> None:
    single = group_maker(Roles(), GroupSettings(4))
    assert type(single) is SingleTurnGroups and single.group_size == 4
    limits = {"max_turns": 3, "max_tokens": 8, "max_model_len": 64}
    multi = group_maker(Roles(env=object()), GroupSettings(4, limits))  # a placeholder env: never called
    assert type(multi) is MultiTurnGroups and (multi.max_turns, multi.max_tokens, multi.max_model_len) == (3, 8, 64)
    with pytest.raises(ValueError, match="need an environment service"):
        group_maker(Roles(), GroupSettings(4, limits))
    with pytest.raises(ValueError, match="need a group maker, or the rollout workers"):
        Rollouts(Roles(), None, 1, 1)
