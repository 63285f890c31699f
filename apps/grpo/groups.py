"""The GRPO algorithm, one group at a time: a prompt becomes one scored group for the buffer.

A group maker turns one prompt into ``group_size`` scored episodes::

    prompt -> policy completions (behaviour logprobs, policy version)
           -> rewards (functions and learned models, mixed: apps.grpo.reward_mix) and
              reference logprobs, side by side
           -> advantages, normalised over the group (forge.losses.group_advantages)
           -> EpisodeBatch.of_group: the scored group, packed, on its way to the buffer

``SingleTurnGroups`` (here) is the one above. ``MultiTurnGroups`` (``apps.grpo.multiturn``) plays
each completion as a conversation with an environment service first; ``AgentGroups``
(``apps.grpo.agents``) runs a user's agent through the OpenAI front door. Everything around a maker
is scheduling, and it lives elsewhere:

- ``apps.grpo.rollouts.Rollouts`` draws the prompts, keeps enough groups in flight (backpressure),
  applies dynamic sampling and writes the finished groups to the buffer;
- ``apps.grpo.rollout_workers.RolloutWorker`` holds a maker in another process
  (``rollout.workers``);
- ``make_with_retries`` (here) makes a group again from the same prompt, with the same id, when a
  replica under it died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from apps.common.launch import Roles
from apps.common.roles import RoleFailed, call_role
from apps.grpo.agents import AgentGroups, AgentSettings
from apps.grpo.multiturn import MultiTurnGroups
from apps.grpo.reward_mix import RewardMix, RewardSettings
from forge.actors import prompt_key
from forge.actors.reference_model import ResponseGroup
from forge.losses import group_advantages
from forge.observability import record_metric
from forge.types import EpisodeBatch, PackedGroup, Prompt

if TYPE_CHECKING:
    from apps.grpo.config import GRPOConfig

logger = logging.getLogger("forge.grpo")

MAX_GROUP_ATTEMPTS = 10
"""Tries of one group before the run gives up on it (each try follows a replica's death)."""


class GroupMaker(Protocol):
    """Turns one prompt into one scored group; raises ``RoleFailed`` when a role fails it."""

    async def make(self, prompt: Prompt, group_id: str) -> EpisodeBatch: ...


@dataclass
class GroupSettings:
    """What a group maker needs of the run's config (a rollout worker gets it, not the config)."""

    group_size: int
    multiturn: dict[str, int] | None = None
    """``max_turns``, ``max_tokens`` and ``max_model_len`` of a multi-turn run; None: single-turn."""
    agent: AgentSettings | None = None
    """An agent run's (``rollout.agent``); None: no agent."""
    rewards: RewardSettings | None = None
    """A single-turn run's reward sources; None: the reward functions' weighted sum, as the
    reward service weighs them."""

    @classmethod
    def from_config(cls, cfg: GRPOConfig, model_path: str) -> GroupSettings:
        """The run's settings; ``model_path`` is the policy's checkpoint (an agent's tokenizer)."""
        multiturn = agent = None
        p = cfg.policy
        if cfg.env.cls:
            limits = (cfg.env.max_turns, p.max_tokens, p.max_model_len)
            multiturn = dict(zip(("max_turns", "max_tokens", "max_model_len"), limits))
        if cfg.rollout.agent:
            timeout = cfg.rollout.agent_timeout_s
            agent = AgentSettings(cfg.rollout.agent, timeout, model_path, p.max_model_len, p.max_tokens, p.temperature)
        r = cfg.reward
        return cls(cfg.group_size, multiturn, agent, RewardSettings(dict(r.fns), dict(r.models), r.normalize))


def group_maker(roles: Roles, settings: GroupSettings) -> GroupMaker:
    """The run's group maker over ``roles``: an agent's, a multi-turn one when the run has an
    environment, else single-turn."""
    if settings.agent is not None:
        return AgentGroups(roles, settings.group_size, settings.agent)
    if settings.multiturn is None:
        return SingleTurnGroups(roles, settings.group_size, settings.rewards)
    return MultiTurnGroups(roles, settings.group_size, **settings.multiturn)


def check_count(role: str, what: str, expected: int, received: int) -> None:
    """A role answered a group with the wrong number of results: fail the run naming it, rather
    than zip the results short (a group of fewer episodes, rewards against the wrong completions).
    Not recoverable: the role's own code is wrong, and generating again would only repeat it."""
    if received != expected:
        raise RoleFailed(role, f"returned {received} {what} for a group that needs {expected}")


class SingleTurnGroups:
    """One prompt, ``group_size`` sampled completions, scored as one group.

    One request per group to the policy, the reward and the reference, not one per completion:
    the controller's cost per sequence was its cost per request (``docs/benchmarks.md``, section
    17). The group stays packed all the way (``PackedGroup`` in, ``EpisodeBatch.of_group`` out).
    """

    def __init__(self, roles: Roles, group_size: int, rewards: RewardSettings | None = None) -> None:
        self.roles = roles
        self.group_size = group_size
        self.mix = None if rewards is None else RewardMix(rewards)

    async def make(self, prompt: Prompt, group_id: str) -> EpisodeBatch:
        """Prompt -> completions -> rewards and reference logprobs -> advantages -> scored group."""
        t0 = time.perf_counter()
        policy = self.roles.policy
        group = PackedGroup.of(await call_role("policy", policy.generate.route(prompt, key=prompt_key(prompt))))
        t1 = time.perf_counter()
        check_count("policy", "completions", self.group_size, len(group))
        scores, ref_logprobs = await asyncio.gather(self._rewards(group), self._ref_logprobs(group))
        check_count("reference", "reference logprobs", group.token_ids.numel(), ref_logprobs.numel())
        record_metric("rollout/generate_latency_s", t1 - t0)
        record_metric("rollout/score_latency_s", time.perf_counter() - t1)
        return EpisodeBatch.of_group(group, group_id, ref_logprobs, scores, group_advantages(scores))

    # Routed inside these coroutines, so a group cancelled before they run queues nothing.
    async def _rewards(self, group: PackedGroup) -> torch.Tensor:
        """The group's rewards, float32 [n]: the functions' weighted sum, or every source mixed."""
        request = (group.prompt, group.texts)
        if self.mix is None:
            return torch.tensor(
                self._checked(await call_role("reward", self.roles.reward.score_groups.route(request)), len(group)),
                dtype=torch.float32,
            )
        sources = self.mix.settings

        async def fn_parts() -> list[Any]:
            if not sources.fns:
                return [{}] * len(group)
            return await call_role("reward", self.roles.reward.score_group_parts.route(request))

        async def model_scores() -> list[list[float]] | None:
            if not sources.models:
                return None
            return await call_role("reward_model", self.roles.reward_model.score_groups.route(request))

        parts, learned = await asyncio.gather(fn_parts(), model_scores())
        if learned is not None:
            check_count("reward_model", "reward-model scores", len(group), len(learned))
        return self.mix.combine(self._checked(parts, len(group)), learned)

    @staticmethod
    def _checked(rewards: list[Any], n: int) -> list[Any]:
        """The reward service's answers for a group of ``n``, or the run fails naming it."""
        check_count("reward", "rewards", n, len(rewards))
        failed = next((r for r in rewards if isinstance(r, Exception)), None)
        if failed is not None:  # a reward function raised on one of the group's responses
            raise RoleFailed("reward", failed)
        return rewards

    async def _ref_logprobs(self, group: PackedGroup) -> torch.Tensor:
        """The group's reference logprobs, flat like ``group.logprobs``."""
        if self.roles.reference is None:  # reference.from_base: the trainer scores the base itself
            return torch.zeros(group.token_ids.shape, dtype=torch.float32)
        responses = ResponseGroup(group.prompt_ids, group.token_ids, group.response_lens)
        return await call_role("reference", self.roles.reference.logprobs_groups.route(responses))


async def make_with_retries(
    make: Callable[[Prompt, str], Awaitable[EpisodeBatch]], prompt: Prompt, group_id: str
) -> tuple[EpisodeBatch, int]:
    """``make(prompt, group_id)``'s group, and how many times it was made again after a replica's death
    (``RoleFailed.recoverable``: the same prompt, the same ``group_id``, so the buffer refuses a
    second copy if a first try got through). Any other failure, or the last try's, is raised."""
    for attempt in range(1, MAX_GROUP_ATTEMPTS + 1):
        try:
            return await make(prompt, group_id), attempt - 1
        except RoleFailed as exc:
            if not exc.recoverable or attempt == MAX_GROUP_ATTEMPTS:
                raise
            logger.info("group %s: %s; generating it again (try %d)", group_id, exc, attempt + 1)
            await asyncio.sleep(min(0.2 * attempt, 2.0))  # the service is restarting the replica
    raise AssertionError("unreachable")
