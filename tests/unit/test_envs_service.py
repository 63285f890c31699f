"""The environment service and multi-turn rollouts on real Monarch process meshes.

The environments here misbehave on purpose (raise, return a malformed step, hang, never
finish): each must fail its own trajectory, with a clear message, and nothing else. The policy
and reference are small scripted ForgeActor services (no vLLM), started once for the module, so
the rollout logic runs in seconds; the same services score a single-turn group too (the policy
is also its reward). tests/integration/test_multiturn.py drives the real vLLM policy.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest
import torch

from apps.common.launch import Roles
from apps.common.roles import RoleFailed
from apps.grpo.groups import SingleTurnGroups
from apps.grpo.multiturn import MultiTurnGroups
from forge.actors.policy import PackedGroups
from forge.actors.reference_model import ResponseGroup
from forge.controller import Batching, ForgeActor, endpoint
from forge.envs import (
    Action,
    EnvActor,
    EnvConfig,
    EnvError,
    Environment,
    EnvSessionRouter,
    ResetRequest,
    SessionKey,
    StepRequest,
    StepResult,
)
from forge.losses import group_advantages
from forge.types import Completion, PackedGroup, Prompt, TurnRequest, TurnResult

pytestmark = pytest.mark.timeout(120)

PROMPT = Prompt("p0", "12=", "21")


class FlakyEnv(Environment):
    """Episode k of a replica behaves as ``modes[k % len(modes)]`` (or as the prompt's meta says)."""

    _episodes = itertools.count()

    def __init__(self, modes: list[str] | None = None) -> None:
        modes = modes or ["ok"]
        self.mode = modes[next(self._episodes) % len(modes)]

    async def reset(self, prompt: Prompt):
        self.mode = prompt.meta.get("mode", self.mode)
        if self.mode == "reset_raises":
            raise RuntimeError("no reset today")
        return [4, 5, 6]

    async def step(self, action: Action):
        if self.mode == "raises":
            raise ValueError("the sandbox crashed")
        if self.mode == "malformed":
            return {"observation": [1]}
        if self.mode == "hangs":
            await asyncio.sleep(3600)
        if self.mode == "never_done":
            return StepResult([9], 0.0, False)
        done = action.turn == 1
        return StepResult([] if done else [7, 8], 1.0 if done else 0.0, done)


_REWARDS = (0.0, 1.0, 0.0, 3.0)
"""The rewards of a single-turn group's four completions (each completion's text)."""


class ScriptedPolicy(ForgeActor):
    """Samples two tokens per turn (a function of the history's length) with logprob -0.5 each;
    a single-turn group of four completions whose texts are their rewards, and scores them."""

    @endpoint(batch=Batching(max_size=64, max_wait_s=0.002))
    async def generate_turn(self, requests: list[TurnRequest]) -> list[TurnResult]:
        return [
            TurnResult(torch.tensor([10 + len(r.history_ids), 11]), torch.tensor([-0.5, -0.5]), "ab", 3)
            for r in requests
        ]

    @endpoint(batch=Batching(max_size=8, max_wait_s=0.002))
    async def generate(self, prompts: list[Prompt]) -> list[PackedGroup]:
        """4 completions of 1, 2, 1, 2 tokens, behaviour logprobs in (-2, -1], at version 7."""
        outputs = [
            [
                Completion(
                    torch.tensor([1, 2, 3]),
                    torch.arange(10 * j, 10 * j + 1 + j % 2),
                    -1.0 - 0.1 * j - 0.01 * torch.arange(1 + j % 2, dtype=torch.float32),
                    str(reward),
                    7,
                )
                for j, reward in enumerate(_REWARDS)
            ]
            for _ in prompts
        ]
        return PackedGroups.pack(prompts, outputs, 7).unpack()

    @endpoint(batch=Batching(max_size=64, max_wait_s=0.002))
    async def score_groups(self, groups: list[tuple[Prompt, list[str]]]) -> list[list[float | Exception]]:
        """Each text's number; a prompt with ``meta["fail"]`` gets an error for its last response."""
        return [
            [float(text) for text in texts[:-1]]
            + [ValueError("no reward today") if p.meta.get("fail") else float(texts[-1])]
            for p, texts in groups
        ]


class ScriptedReference(ForgeActor):
    """Scores response token t at ``-3 - t / 10``: apart from the policy's -0.5, so a group's
    episodes show which logprobs went where."""

    @endpoint(batch=Batching(max_size=64, max_wait_s=0.002))
    async def logprobs(self, items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        return [-3.0 - 0.1 * torch.arange(response.numel(), dtype=torch.float32) for _, response in items]

    @endpoint(batch=Batching(max_size=64, max_wait_s=0.002))
    async def logprobs_groups(self, groups: list[ResponseGroup]) -> list[torch.Tensor]:
        """A group's response tokens, flat, at ``-3 - t / 100``."""
        return [-3.0 - 0.01 * torch.arange(g.response_ids.numel(), dtype=torch.float32) for g in groups]


@pytest.fixture(scope="module")
async def scripted():
    """The scripted policy and reference services, shared by the module's rollout tests."""
    policy = await ScriptedPolicy.options(procs=1, num_replicas=1).as_service()
    reference = await ScriptedReference.options(procs=1, num_replicas=1).as_service()
    yield policy, reference
    await asyncio.gather(policy.shutdown(), reference.shutdown())


async def _env(modes: list[str], replicas: int = 1, timeout: float = 1.0):
    config = EnvConfig(f"{__name__}:FlakyEnv", {"modes": modes}, step_timeout_s=timeout)
    return await EnvActor.options(procs=1, num_replicas=replicas, router=EnvSessionRouter).as_service(config)


async def _held(env) -> int:
    return sum(await env.num_episodes.fanout())


async def test_steps_are_prebatched_across_sessions_and_each_bad_episode_fails_alone():
    """32 sessions over 2 replicas: every session reaches the replica that holds it, steps share
    batches, and each misbehaving episode fails only its own caller with a message that names
    the session and the cause."""
    env = await _env(["ok"], replicas=2)
    try:
        modes = ["ok"] * 28 + ["raises", "malformed", "hangs", "reset_raises"]
        sessions = [f"s{i}" for i in range(len(modes))]
        prompts = [Prompt("p", "1=", "1", meta={"mode": m}) for m in modes]
        resets = await asyncio.gather(
            *(env.reset.route(ResetRequest(s, p), key=SessionKey(s)) for s, p in zip(sessions, prompts)),
            return_exceptions=True,
        )
        assert isinstance(resets[-1], EnvError) and "'s31' reset" in str(resets[-1])
        assert "RuntimeError: no reset today" in str(resets[-1])
        assert all(r.observation_ids.tolist() == [4, 5, 6] for r in resets[:-1])
        steps = await asyncio.gather(
            *(
                env.step.route(StepRequest(s, Action((1,), "a", 0)), key=SessionKey(s))
                for s in sessions[:-1]  # the one whose reset failed has no episode
            ),
            return_exceptions=True,
        )
        assert all(r.observation_ids.tolist() == [7, 8] and not r.done for r in steps[:28])
        raised, malformed, hung = steps[28:]
        assert (
            isinstance(raised, EnvError) and "ValueError: the sandbox crashed" in str(raised) and "'s28'" in str(raised)
        )
        assert isinstance(malformed, EnvError) and "must return a StepResult" in str(malformed)
        assert isinstance(hung, EnvError) and "step_timeout_s=1.0" in str(hung)
        stats = env.metrics()["endpoints"]["step"]
        assert stats["batches"] < stats["requests"] / 4  # steps of many sessions share a batch
        assert await _held(env) == 28  # the failed episodes were dropped
        again = await env.step.route(StepRequest("s28", Action((1,), "a", 1)), key=SessionKey("s28"))
    except EnvError as exc:
        assert "no episode for this session" in str(exc)
    else:
        raise AssertionError(f"a failed episode took another step: {again}")
    finally:
        await env.shutdown()


async def test_multiturn_group_trains_on_the_trajectories_that_finished(scripted, caplog):
    """A group of 6 where one env raises, one returns a malformed step, one hangs and one never
    finishes: the group holds the 2 good trajectories, each failure is logged with its session
    and cause, and the env holds no episode afterwards."""
    policy, reference = scripted
    env = await _env(["ok", "raises", "malformed", "hangs", "never_done", "ok"])
    try:
        roles = Roles(policy=policy, reference=reference, env=env)
        groups = MultiTurnGroups(roles, 6, max_turns=3, max_tokens=2, max_model_len=64)
        with caplog.at_level(logging.WARNING, logger="forge.grpo"):
            group = await groups.make(PROMPT, "g0")
        assert len(group) == 2 and groups.failed_trajectories == 4
        episode = group.unpack()[0]
        # prompt [4, 5, 6]; turn 0 samples [13, 11] (history of 3), env answers [7, 8];
        # turn 1 samples [17, 11] (history of 7) and the episode is done.
        assert episode.prompt_ids.tolist() == [4, 5, 6]
        assert episode.response_ids.tolist() == [13, 11, 7, 8, 17, 11]
        assert episode.loss_mask.tolist() == [True, True, False, False, True, True]
        assert episode.reward == 1.0 and episode.policy_version == 3
        # Both finished trajectories won: equal rewards, zero advantages. The behaviour logprobs are
        # the policy's (0 on the env's tokens), the reference's are the reference's.
        assert episode.advantage == 0.0
        assert episode.behaviour_logprobs.tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]
        assert episode.ref_logprobs.tolist() == pytest.approx([-3.0, -3.1, -3.2, -3.3, -3.4, -3.5])
        text = "\n".join(r.getMessage() for r in caplog.records)
        for cause in ("ValueError: the sandbox crashed", "must return a StepResult", "step_timeout_s", "max_turns=3"):
            assert cause in text
        assert text.count("trajectory failed (the run goes on without it)") == 4
        assert await _held(env) == 0  # finished and failed episodes alike are gone
    finally:
        await env.shutdown()


async def test_a_group_whose_every_trajectory_fails_stops_the_run_with_the_cause(scripted):
    """A group whose every trajectory fails (its env raises; or its next turn, history plus
    max_tokens, would pass max_model_len) is tried 3 times, then stops the run naming the cause."""
    policy, reference = scripted
    env = await _env(["raises"])
    try:
        roles = Roles(policy=policy, reference=reference, env=env)
        groups = MultiTurnGroups(roles, 2, max_turns=3, max_tokens=2, max_model_len=64)
        with pytest.raises(RoleFailed, match="every trajectory of group g1 failed 3 times.*sandbox crashed") as info:
            await groups.make(PROMPT, "g1")
        assert not info.value.recoverable
        # Turn 0: 3 prompt tokens + 2 <= 8; turn 1: 3 + 2 sampled + 2 env tokens, + 2 > 8.
        short = MultiTurnGroups(roles, 1, max_turns=3, max_tokens=2, max_model_len=8)
        with pytest.raises(RoleFailed, match=r"turn 1 would pass policy.max_model_len=8 \(7 tokens of history"):
            await short.make(Prompt("p2", "12=", "21", meta={"mode": "ok"}), "g2")
    finally:
        await env.shutdown()


async def test_a_single_turn_group_takes_behaviour_reference_rewards_and_advantages_each_from_its_role(scripted):
    """SingleTurnGroups.make: each completion's behaviour logprobs are the policy's, its reference
    logprobs the reference's, its reward the reward's and its advantage the group-normalised reward;
    a reward that failed on one response fails the group, naming the reward role."""
    policy, reference = scripted
    groups = SingleTurnGroups(Roles(policy=policy, reward=policy, reference=reference), 4)
    episodes = (await groups.make(PROMPT, "g7")).unpack()
    assert [e.reward for e in episodes] == list(_REWARDS)
    assert [e.advantage for e in episodes] == group_advantages(torch.tensor(_REWARDS)).tolist()  # -0.82, 0, -0.82, 1.63
    assert [e.response_ids.tolist() for e in episodes] == [[0], [10, 11], [20], [30, 31]]
    behaviour = torch.cat([e.behaviour_logprobs for e in episodes]).tolist()
    assert behaviour == pytest.approx([-1.0, -1.1, -1.11, -1.2, -1.3, -1.31])
    assert torch.cat([e.ref_logprobs for e in episodes]).tolist() == pytest.approx(
        [-3.0, -3.01, -3.02, -3.03, -3.04, -3.05]
    )
    assert {e.group_id for e in episodes} == {"g7"} and {e.policy_version for e in episodes} == {7}
    assert all(e.prompt_ids.tolist() == [1, 2, 3] for e in episodes)
    with pytest.raises(RoleFailed, match="no reward today") as info:
        await groups.make(Prompt("p1", "12=", "21", meta={"fail": True}), "g8")
    assert info.value.role == "reward"
