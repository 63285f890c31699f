"""``rollout.workers``: the GRPO app's groups made in worker processes, books kept by the controller.

Real processes throughout: the stand-in policy, reference and reward services of
``benchmarks/rollout_scale.py`` (the real endpoints over an instant engine), real rollout
workers attached to them, the real buffer and dataset, real SIGKILLs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # test_rollout_scale's ShortReward

import rollout_scale  # noqa: E402

from apps.common.launch import Roles  # noqa: E402
from apps.common.roles import RoleFailed  # noqa: E402
from apps.grpo.groups import GroupSettings  # noqa: E402
from apps.grpo.rollout_workers import RolloutWorker, start_rollout_workers, stop_rollout_workers  # noqa: E402
from apps.grpo.rollouts import Rollouts  # noqa: E402
from forge.controller import ReplicaState, endpoint  # noqa: E402
from forge.types import EpisodeBatch, Prompt  # noqa: E402
from tests.unit.controller.waits import until, until_answer  # noqa: E402

GROUP = rollout_scale.GROUP_SIZE
PROMPTS = 4


class KillableWorker(RolloutWorker):
    """The real worker, plus what the tests read: its pid and the generations it routes to."""

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def generations(self, role: str) -> list[int]:
        return [r.generation for r in self.services[role].service.replicas if r.state is ReplicaState.HEALTHY]


class KillablePolicy(rollout_scale.StandInPolicy):
    @endpoint
    async def pid(self) -> int:
        return os.getpid()


async def start(replicas: int, workers: int, **stand_ins) -> tuple[Roles, Rollouts, list[asyncio.Task], object]:
    roles = await rollout_scale.start_stand_ins(replicas, policy_cls=KillablePolicy, **stand_ins)
    try:
        roles.rollout, views = await start_rollout_workers(
            roles, workers, GroupSettings(GROUP), worker_cls=KillableWorker, restart_backoff_s=0.2
        )
        await rollout_scale.start_local(roles, PROMPTS, f"w{workers}")
    except BaseException:
        await roles.stop(timeout_s=60)
        raise
    rollouts = Rollouts(roles, None, PROMPTS, PROMPTS, workers=roles.rollout)
    return roles, rollouts, rollouts.start(), views


async def stop(roles: Roles, rollouts: Rollouts, tasks: list[asyncio.Task], views) -> None:
    await rollout_scale.stop_cell(roles, rollouts, tasks)
    await stop_rollout_workers(roles, views)
    await roles.stop(timeout_s=60)


async def steps(rollouts: Rollouts, tasks: list[asyncio.Task], n: int) -> list[EpisodeBatch]:
    taken: list[EpisodeBatch] = []
    for _ in range(n):
        taken += await rollout_scale.take_step(rollouts, tasks, PROMPTS)
    return taken


async def kill_and_go_on(
    victim: Any, rollouts: Rollouts, tasks: list[asyncio.Task], n: int, ready: Callable[[], bool] = lambda: True
) -> list[EpisodeBatch]:
    """SIGKILL the replica ``victim``, take ``n`` steps meanwhile, then wait (60 s at most) until
    it is back as generation 1 and ``ready()``; returns the steps' groups."""
    os.kill(await victim.call("pid", (), {}, 10), signal.SIGKILL)
    taken = await steps(rollouts, tasks, n)

    def back() -> bool:
        return victim.state is ReplicaState.HEALTHY and victim.generation == 1 and ready()

    await until(back, f"replica {victim.mesh_name} back as generation 1, and ready", 60)
    return taken


def assert_exactly_once(rollouts: Rollouts, taken: list[EpisodeBatch]) -> None:
    ids = [g.group_ids[0] for g in taken]
    assert len(ids) == len(set(ids)), "a group was trained twice"
    assert all(len(g) == GROUP and len(set(g.group_ids)) == 1 for g in taken)
    counts = rollouts.group_counts()
    assert counts["groups/lost"] == 0 and counts["groups/duplicates"] == 0 and counts["groups/unaccounted"] == 0


async def test_workers_make_the_groups_and_the_controller_sends_one_request_per_group():
    """Three steps of four groups through two workers: scored groups with a reward spread, each
    trained once, every order served by a worker, and not one policy, reward or reference request
    from the controller's own process."""
    roles, rollouts, tasks, views = await start(replicas=1, workers=2)
    try:
        taken = await steps(rollouts, tasks, 3)
        assert_exactly_once(rollouts, taken)
        assert all(float(g.advantages.abs().sum()) > 0 for g in taken)
        orders = roles.rollout.metrics()["endpoints"]["groups"]
        assert orders["requests"] >= 12 and orders["batches"] < orders["requests"]  # prebatched orders
        for role in ("policy", "reward", "reference"):
            own = getattr(roles, role).metrics()["endpoints"]
            assert all(e["requests"] == 0 for e in own.values()), (role, own)
        await rollout_scale.stop_cell(roles, rollouts, tasks)
        await stop_rollout_workers(roles, views)  # mid-group: the workers stop their groups first
        assert roles.rollout is None
        # Every replica's first process still answers the controller's probe (one a worker's stop
        # had failed would not); a reply undeliverable to a stopped worker comes back only after
        # Monarch's delivery timeout: test_attach's test_a_replica_outlives_a_caller_that_died_...
        for role in ("policy", "reward", "reference"):
            replicas = getattr(roles, role).service.replicas
            assert all([await r.probe(10) for r in replicas]), role
            assert all(r.state is ReplicaState.HEALTHY and r.generation == 0 for r in replicas), role
    finally:
        await rollout_scale.stop_cell(roles, rollouts, tasks)
        await stop_rollout_workers(roles, views)
        await roles.stop(timeout_s=60)


async def test_a_killed_worker_is_restarted_and_its_groups_made_again_none_lost_none_twice():
    """One of two workers SIGKILLed mid-run: its orders are resent or generated again, the
    worker comes back (attached to the roles by its resync: no view push is left to do it) and
    serves again; every group is trained once, none lost."""
    roles, rollouts, tasks, views = await start(replicas=1, workers=2)
    try:
        taken = await steps(rollouts, tasks, 1)
        await views.close()  # the roles' replicas do not change here: only the resync can attach the new worker
        victim = roles.rollout.service.replicas[0]
        taken += await kill_and_go_on(victim, rollouts, tasks, 4)
        assert await victim.call("generations", ("policy",), {}, 10) == [0]  # attached before traffic
        before = victim.metrics()["endpoints"].get("groups", {}).get("requests", 0)
        taken += await steps(rollouts, tasks, 3)
        assert victim.metrics()["endpoints"]["groups"]["requests"] > before  # it takes orders again
        assert_exactly_once(rollouts, taken)
        assert roles.rollout.metrics()["retried"] + rollouts.counts.regenerated >= 1
    finally:
        await stop(roles, rollouts, tasks, views)


async def test_a_policy_replica_killed_under_the_workers_reaches_them_restarted():
    """A policy replica SIGKILLed while workers use it: their groups on it are generated again
    on the other replica; once the controller restarts it, every worker routes to its new
    generation (the views pushed after the restart); no group is lost or trained twice."""
    roles, rollouts, tasks, views = await start(replicas=2, workers=2)
    try:
        taken = await steps(rollouts, tasks, 1)
        victim = roles.policy.service.replicas[1]
        taken += await kill_and_go_on(victim, rollouts, tasks, 3, ready=lambda: views.pushes >= 2)

        async def every_worker_routes_to_both() -> bool:  # the push after the restart may still be on its way
            return await roles.rollout.generations.fanout("policy") == [[0, 1], [0, 1]]

        await until_answer(every_worker_routes_to_both, "every worker to route to generations 0 and 1", 20)
        taken += await steps(rollouts, tasks, 2)
        assert_exactly_once(rollouts, taken)
    finally:
        await stop(roles, rollouts, tasks, views)


async def test_a_role_answering_a_worker_with_the_wrong_count_stops_the_group_naming_it():
    """The reward returns 15 rewards for 16 completions: the worker's group fails with the
    reward's own error, and the controller's ``make_group`` raises it as the rollout role's,
    not recoverable (generating again would repeat it)."""
    from test_rollout_scale import ShortReward

    roles = await rollout_scale.start_stand_ins(1, reward_cls=ShortReward)
    try:
        roles.rollout, views = await start_rollout_workers(roles, 1, GroupSettings(GROUP))
        rollouts = Rollouts(roles, None, 1, 1, workers=roles.rollout)
        with pytest.raises(RoleFailed) as caught:
            await rollouts.make_group(Prompt("p0", "1 + 1", "2"), "p0#0")
        await rollouts.close()
        await stop_rollout_workers(roles, views)
    finally:
        await roles.stop(timeout_s=60)
    assert caught.value.role == "rollout" and not caught.value.recoverable
    assert "role 'reward' failed" in str(caught.value) and "returned 15 rewards for a group that needs 16" in str(
        caught.value
    )
