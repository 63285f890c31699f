"""A group of trajectory runs, scored: what multi-turn and agent group makers share.

A run is one play of the prompt (a conversation with an environment, an agent's episode) and
yields its trajectories (one, or an agent's several when it rewrote its history) with one reward.
``play_group`` plays ``group_size`` runs at once; a run that cannot finish (``TrajectoryFailed``)
fails alone, with a warning naming it, and the group trains on the others. A group whose every
run failed is played again (``MAX_GROUP_TRIES`` times, then the run stops: the environment or
agent is broken, not unlucky). Anything else a run raises (a replica's death: ``RoleFailed``)
fails the whole group, for ``groups.make_with_retries`` to make again.

``score_group`` then asks the reference for every trajectory's logprobs, normalises the runs'
rewards over the group (``forge.losses.group_advantages``) and packs the episodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import torch

from apps.common.launch import Roles
from apps.common.roles import RoleFailed, call_role
from forge.envs import Trajectory
from forge.losses import group_advantages
from forge.observability import record_metric
from forge.types import EpisodeBatch

logger = logging.getLogger("forge.grpo")

MAX_GROUP_TRIES = 3
"""Tries of a group whose every run failed before the run stops."""


class TrajectoryFailed(Exception):
    """One run cannot go on (its environment or agent failed, or it ran out of turns or context)."""


Run = list[Trajectory]
"""One play's trajectories, all with the play's reward."""


async def play_group(
    play: Callable[[], Awaitable[Run]], group_size: int, group_id: str, role: str
) -> tuple[list[Run], int]:
    """``group_size`` runs of ``play``, less the failed ones, and how many failed (every try
    counted); ``RoleFailed(role)`` if all of them fail ``MAX_GROUP_TRIES`` times."""
    failures = 0
    for attempt in range(1, MAX_GROUP_TRIES + 1):
        results = await asyncio.gather(*(play() for _ in range(group_size)), return_exceptions=True)
        for result in results:
            # A dying replica (recoverable): the caller makes the whole group again.
            # Anything else that is not the run's own failure stops the run.
            if isinstance(result, BaseException) and not isinstance(result, TrajectoryFailed):
                raise result
        done = [r for r in results if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, TrajectoryFailed)]
        failures += len(failed)
        if failed:
            record_metric("rollout/failed_trajectories", len(failed), "sum")
        if done:
            return done, failures
        logger.error(
            "group %s: all %d runs failed (try %d of %d); last: %s",
            group_id,
            len(failed),
            attempt,
            MAX_GROUP_TRIES,
            failed[-1],
        )
    raise RoleFailed(role, f"every trajectory of group {group_id} failed {MAX_GROUP_TRIES} times: {failed[-1]}")


def failed(error: TrajectoryFailed) -> TrajectoryFailed:
    """``error``, logged as a warning: the run goes on without that trajectory."""
    logger.warning("trajectory failed (the run goes on without it): %s", error)
    return error


async def score_group(roles: Roles, group_id: str, runs: list[Run], started: float) -> EpisodeBatch:
    """The runs' reference logprobs and group-normalised advantages, packed as one group's episodes."""
    t1 = time.perf_counter()
    trajectories = [t for run in runs for t in run]
    if roles.reference is None:  # reference.from_base: the trainer scores the base itself
        ref_logprobs = [torch.zeros(t.response_ids.shape, dtype=torch.float32) for t in trajectories]
    else:
        ref_logprobs = await call_role(
            "reference",
            roles.reference.logprobs.route_many([(t.prompt_ids, t.response_ids) for t in trajectories]),
        )
    rewards = torch.tensor([run[0].reward for run in runs], dtype=torch.float32)
    advantages = [a for run, a in zip(runs, group_advantages(rewards).tolist()) for _ in run]
    record_metric("rollout/generate_latency_s", t1 - started)
    record_metric("rollout/score_latency_s", time.perf_counter() - t1)
    record_metric("rollout/turns", sum(t.turns for t in trajectories) / len(trajectories))
    record_metric("rollout/tokens_per_trajectory", sum(t.length for t in trajectories) / len(trajectories))
    return EpisodeBatch.pack(
        [t.to_episode(group_id, ref, float(a)) for t, ref, a in zip(trajectories, ref_logprobs, advantages)]
    )
