"""One replica over several hosts (``options(hosts=H, host_pool=...)``): the hosts are worker
processes on loopback, the replica is one flat proc mesh whose ranks run torch.distributed
(gloo) together, and a host that dies fails the replica with an error naming it."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import time

import psutil
import pytest
import torch
import torch.distributed as dist
from monarch.actor import current_rank, current_size

from forge.controller import ForgeActor, ReplicaState, endpoint
from forge.controller.hosts import HostPool, NotEnoughHosts, start_local_worker

# gloo binds the interface of the host name unless told otherwise; the test stays on loopback.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AllReduce(ForgeActor):
    """A minimal SPMD actor: every rank joins one gloo group and sums a tensor with the others."""

    @endpoint
    async def where(self) -> dict:
        return {"rank": current_rank().rank, "sizes": dict(current_size()), "host_pid": os.getppid()}

    @endpoint
    async def join(self, port: int) -> None:
        rank, world = current_rank().rank, math.prod(current_size().values())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    @endpoint
    async def sum_ranks(self) -> float:
        t = torch.tensor([float(current_rank().rank + 1)])
        dist.all_reduce(t)
        return t.item()


@pytest.fixture
def two_workers():
    workers = [start_local_worker(free_port()) for _ in range(2)]
    yield workers
    for w in workers:
        w.kill()
        w.wait(10)


def addresses_of(workers) -> list[str]:
    return [w.args[-1] for w in workers]


async def test_a_replica_over_two_hosts_is_one_flat_mesh_whose_ranks_all_reduce_together(two_workers):
    pool = HostPool.attach(addresses_of(two_workers))
    actor = await AllReduce.options(hosts=2, procs=1, host_pool=pool, env=LOOPBACK_ENV).as_actor()
    try:
        where = sorted((await actor.where.call()).values(), key=lambda w: w["rank"])
        assert [w["rank"] for w in where] == [0, 1]
        assert all(w["sizes"] == {"procs": 2} for w in where)  # an ordinary proc mesh to the actor
        assert [w["host_pid"] for w in where] == [w.pid for w in two_workers]  # rank r on host r
        await asyncio.wait_for(actor.join.call(free_port()), 60)
        sums = await asyncio.wait_for(actor.sum_ranks.call(), 60)
        assert list(sums.values()) == [3.0, 3.0]  # 1 + 2, on both hosts
    finally:
        await ForgeActor.shutdown(actor)  # stops the processes on both hosts
    deadline = time.monotonic() + 15
    while any(psutil.Process(w.pid).children() for w in two_workers):
        assert time.monotonic() < deadline, "the replica's processes outlived its shutdown"
        await asyncio.sleep(0.2)


async def test_a_host_that_dies_fails_the_replica_with_an_error_naming_it(two_workers):
    pool = HostPool.attach(addresses_of(two_workers))
    svc = await AllReduce.options(
        hosts=2,
        host_pool=pool,
        env=LOOPBACK_ENV,
        max_restarts=1,
        restart_backoff_s=0.1,
        health_interval_s=0.5,
        health_timeout_s=3.0,
    ).as_service()
    try:
        replica = svc.service.replicas[0]
        assert replica.host_indices == [0, 1]
        assert len(await svc.where.fanout()) == 1  # one replica of two ranks
        two_workers[1].kill()
        two_workers[1].wait(10)
        deadline = time.monotonic() + 60
        while replica.state is not ReplicaState.FAILED or replica.restarts < 1:
            assert time.monotonic() < deadline, f"the replica did not fail: {replica.state} {replica.failure}"
            await asyncio.sleep(0.2)
        # Its restart needs two live hosts; one is left: the error says so and names the dead one.
        assert "needs 2" in replica.failure and two_workers[1].args[-1] in replica.failure, replica.failure
        assert pool.dead == {1}
    finally:
        await svc.shutdown()


def test_hosts_larger_than_the_pool_is_a_clear_error():
    pool = HostPool.attach(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])  # lazy: nothing connects
    with pytest.raises(NotEnoughHosts, match=r"hosts=3.*only 2 host"):
        AllReduce.options(hosts=3, host_pool=pool)
    with pytest.raises(ValueError, match=r"hosts=2.*needs host_pool"):
        AllReduce.options(hosts=2)


class _FakeHostMesh:
    """The part of a Monarch HostMesh a HostPool reads: its extent."""

    def __init__(self, n: int) -> None:
        self.extent = type("Extent", (), {"labels": ["hosts"], "sizes": [n]})()


def test_pick_hosts_takes_live_neighbours_in_turn_and_avoids_the_failed_ones():
    pool = HostPool(_FakeHostMesh(4))
    assert [pool.pick_hosts(2) for _ in range(3)] == [[0, 1], [1, 2], [2, 3]]
    pool.mark_dead(1)
    assert pool.pick_hosts(2) == [2, 3]
    assert pool.pick_hosts(1, avoid=[0]) in ([2], [3])
    with pytest.raises(NotEnoughHosts, match=r"needs 3 neighbouring live host.*dead: \['#1'\]"):
        pool.pick_hosts(3)
