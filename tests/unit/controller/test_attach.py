"""forge.controller.attach: a service called from a process that does not own it.

Real replicas (one process each), a real second process (an actor that attaches the service from
a view sent to it), real SIGKILLs: the attached caller routes and batches on its own, a death
fails its calls at once, the owner's restart reaches it in a new view, and a replica outlives a
caller that died while it worked for it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from waits import until, until_answer

from forge.controller import (
    ActorOptions,
    Batching,
    ForgeActor,
    NoHealthyReplica,
    ReplicaState,
    ServiceView,
    attach,
    attached_replicas,
    endpoint,
    service_view,
)
from forge.controller.attach import ReplicaView


class Adder(ForgeActor):
    def __init__(self) -> None:
        self.working = 0  # slow calls that have started here
        self.dropped = 0  # replies this replica could not deliver (their caller died)
        self.released = asyncio.Event()

    def _handle_undeliverable_message(self, message: object) -> bool:
        self.dropped += 1
        return super()._handle_undeliverable_message(message)

    @endpoint(batch=Batching(max_size=8, max_wait_s=0.005))
    async def add_one(self, items: list[int]) -> list[int]:
        return [x + 1 for x in items]

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint(concurrent=True)
    async def slow(self, x: int) -> int:
        """Answers once the test releases this replica: in flight for as long as the test needs."""
        self.working += 1
        await self.released.wait()
        return x

    @endpoint(concurrent=True)
    async def release(self) -> None:
        self.released.set()

    @endpoint(concurrent=True)
    async def counts(self) -> tuple[int, int]:
        """(slow calls started, replies dropped)."""
        return self.working, self.dropped


class Caller(ForgeActor):
    """A second process's view of the service: attaches it, calls it, takes newer views."""

    @endpoint
    async def attach(self, view: ServiceView) -> None:
        self.adder = await attach(view)

    @endpoint
    async def update(self, view: ServiceView) -> None:
        await attached_replicas(self.adder).apply(view)

    @endpoint(concurrent=True)
    async def add_all(self, items: list[int]) -> list[int]:
        return list(await asyncio.gather(*(self.adder.add_one.route(x) for x in items)))

    @endpoint(concurrent=True)
    async def slow(self, x: int) -> int:
        return await self.adder.slow.route(x)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def states(self) -> list[tuple[str, int]]:
        return [(r.state.value, r.generation) for r in self.adder.service.replicas]

    @endpoint
    async def batches(self) -> int:
        return self.adder.metrics()["endpoints"]["add_one"]["batches"]


async def _counts(owner) -> list[tuple[int, int]]:
    """Each live replica's (slow calls started, replies dropped)."""
    replicas = [r for r in owner.service.replicas if r.state is ReplicaState.HEALTHY]
    return [await r.call("counts", (), {}, 10) for r in replicas]


async def _slow_started(owner) -> bool:
    return any(started for started, _ in await _counts(owner))


async def _dropped(owner) -> bool:
    return any(dropped for _, dropped in await _counts(owner))


@pytest.fixture
async def owner():
    svc = await Adder.options(num_replicas=2, router="round_robin", restart_backoff_s=0.1).as_service()
    yield svc
    await svc.shutdown()


# Monarch gives up on a message it cannot deliver after this long (30 s by default) and only then
# hands it back to its sender; the replicas' processes read it when they start.
DELIVERY_TIMEOUT = {"HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT": "5s"}


@pytest.fixture
async def owner_quick_to_give_up():
    """``owner``, whose replicas give up on an undeliverable reply after 5 s instead of 30 s."""
    options = {"num_replicas": 2, "router": "round_robin", "restart_backoff_s": 0.1, "env": DELIVERY_TIMEOUT}
    svc = await Adder.options(**options).as_service()
    yield svc
    await svc.shutdown()


@pytest.fixture
async def caller():
    actor = await Caller.options(name="caller").as_actor()
    yield actor
    await asyncio.wait_for(ForgeActor.shutdown(actor), 30)


async def test_an_attached_caller_routes_and_batches_on_its_own(owner, caller):
    """From another process, 40 singleton calls reach both replicas in batches, and the owner
    made no request of its own."""
    await caller.attach.call_one(service_view(owner))
    assert await caller.add_all.call_one(list(range(40))) == list(range(1, 41))
    assert 2 <= await caller.batches.call_one() < 40  # prebatched in the caller's process
    assert owner.metrics()["endpoints"].get("add_one", {}).get("batches", 0) == 0  # none went through the owner


async def test_a_dead_replica_fails_attached_calls_at_once_and_a_new_view_brings_it_back(owner, caller):
    """A replica SIGKILLed under an attached caller: its call fails with ReplicaFailed within
    seconds (not a timeout) and is resent to the live replica; after the owner restarts it, the
    new generation is used again once the caller gets the new view."""
    await caller.attach.call_one(service_view(owner))
    victim = owner.service.replicas[0]
    pid = await victim.call("pid", (), {}, 10)
    calls = asyncio.ensure_future(caller.add_all.call_one(list(range(8))))
    slow = asyncio.ensure_future(asyncio.wait_for(caller.slow.call_one(1), 20))
    await until_answer(lambda: _slow_started(owner), "the slow call to reach a replica")
    os.kill(pid, signal.SIGKILL)
    await owner.service.replicas[1].call("release", (), {}, 10)  # the survivor answers it, first or resent
    assert await calls == list(range(1, 9))
    assert await slow == 1  # in flight on one replica or the other: answered, resent if it was the dead one
    await until(lambda: victim.state is ReplicaState.HEALTHY and victim.generation == 1, "the restart", 30)
    await caller.update.call_one(service_view(owner))
    assert await caller.states.call_one() == [("healthy", 1), ("healthy", 0)]
    assert await caller.add_all.call_one(list(range(16))) == list(range(1, 17))


async def test_a_replica_outlives_a_caller_that_died_waiting_for_it(owner_quick_to_give_up, caller):
    """The caller's process is SIGKILLed while a replica works for it: once Monarch hands the
    replica back its undeliverable reply (after the delivery timeout), the replica stays healthy
    in the same process and answers the next caller."""
    owner = owner_quick_to_give_up
    await caller.attach.call_one(service_view(owner))
    pids = [await r.call("pid", (), {}, 10) for r in owner.service.replicas]
    pending = asyncio.ensure_future(caller.slow.call_one(1))
    await until_answer(lambda: _slow_started(owner), "the slow call to reach a replica")
    os.kill(await caller.pid.call_one(), signal.SIGKILL)
    await asyncio.gather(pending, return_exceptions=True)
    for replica in owner.service.replicas:
        await replica.call("release", (), {}, 10)
    await until_answer(lambda: _dropped(owner), "the replica to be handed back its reply to the dead caller", 30)
    assert [await r.call("pid", (), {}, 10) for r in owner.service.replicas] == pids  # the same processes answer
    assert all(r.state is ReplicaState.HEALTHY and r.generation == 0 for r in owner.service.replicas)
    assert await asyncio.wait_for(owner.slow.route(2), 10) == 2


async def test_with_no_live_replica_in_its_view_an_attached_caller_waits_then_says_so(owner):
    """A view in which no replica takes traffic: a call waits up to queue_timeout_s for a newer
    view, then fails with NoHealthyReplica naming the service; shut down, queued items fail."""
    view = service_view(owner)
    view.options = type(view.options)(**{**vars(view.options), "queue_timeout_s": 0.5})
    for replica in view.replicas:
        replica.actor_mesh = None
    handle = await attach(view)
    with pytest.raises(NoHealthyReplica, match=view.name):
        await handle.add_one.route(1)
    await attached_replicas(handle).apply(service_view(owner))
    assert await handle.add_one.route(1) == 2
    await handle.shutdown()
    assert all(r.state is ReplicaState.HEALTHY for r in owner.service.replicas)  # the owner's are untouched


async def test_a_view_of_another_shape_is_refused(owner):
    view = service_view(owner)
    handle = await attach(view)
    view.replicas = view.replicas[:1]
    with pytest.raises(ValueError, match="has 1 replicas; this attached service has 2"):
        await attached_replicas(handle).apply(view)
    with pytest.raises(TypeError, match="owned by this process"):
        attached_replicas(owner)
    await handle.shutdown()


def _view(meshes: list[object | None], generations: list[int]) -> ServiceView:
    """A view of Adder with stand-in actor meshes: ``apply`` only stores them (nothing is called)."""
    replicas = [ReplicaView(i, g, m) for i, (m, g) in enumerate(zip(meshes, generations))]
    return ServiceView(Adder, ActorOptions(num_replicas=len(meshes)), "adder", replicas)


async def test_a_view_swaps_in_a_restarted_generation_and_drops_a_replica_no_longer_routed():
    """apply: a replica the caller still thinks live at generation 0 is replaced by the view's
    generation 1 (its mesh); one the view shows without a mesh stops taking traffic here."""
    first, restarted, other = object(), object(), object()
    handle = await attach(_view([first, other], [0, 0]))
    replicas = handle.service.replicas
    assert [(r.actor_mesh, r.generation, r.accepting) for r in replicas] == [(first, 0, True), (other, 0, True)]
    await attached_replicas(handle).apply(_view([restarted, None], [1, 0]))
    assert (replicas[0].actor_mesh, replicas[0].generation) == (restarted, 1)
    assert replicas[0].accepting and not replicas[1].accepting
    assert handle.service.healthy_replicas() == [replicas[0]]
    await handle.shutdown()
