"""Replicas on two Monarch hosts (separate worker processes on loopback): losing a host moves
its replicas' traffic to the other host and the service keeps answering."""

import asyncio
import os
import socket

import psutil
from waits import bounded, until

from forge.controller import ForgeActor, ReplicaState, endpoint
from forge.controller.hosts import HostPool, start_local_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Echo(ForgeActor):
    @endpoint
    async def where(self) -> int:
        return os.getppid()  # the worker (host) process that started this replica

    @endpoint
    async def echo(self, x: int) -> int:
        await asyncio.sleep(0.01)
        return x


async def test_losing_a_host_moves_its_replicas_to_the_other_host():
    workers = [start_local_worker(free_port()) for _ in range(2)]
    addresses = [f"tcp://127.0.0.1:{w.args[-1].rsplit(':', 1)[1]}" for w in workers]
    svc = None
    try:
        pool = HostPool.attach(addresses)
        svc = await Echo.options(
            num_replicas=2, host_pool=pool, health_interval_s=0.5, health_timeout_s=2.0, restart_backoff_s=0.2
        ).as_service()
        hosts = sorted(await svc.where.fanout())
        assert hosts == sorted(w.pid for w in workers)  # one replica per host

        stop = asyncio.Event()
        answered, failed = 0, []

        async def traffic():
            nonlocal answered
            while not stop.is_set():
                try:
                    assert await svc.echo.route(7) == 7
                    answered += 1
                except Exception as exc:  # must not happen: the service keeps answering
                    failed.append(exc)
                    await asyncio.sleep(0.05)

        clients = [asyncio.ensure_future(traffic()) for _ in range(4)]
        await until(lambda: answered >= 20, "traffic through both hosts before the loss", 10)
        victim = next(r for r in svc.service.replicas if r.host_indices == [1])
        workers[1].kill()
        await until(
            lambda: victim.restarts >= 1 and all(r.state is ReplicaState.HEALTHY for r in svc.service.replicas),
            "the lost host's replica to restart on the other host",
            30,
        )
        assert victim.host_indices == [0]
        before = answered
        await until(lambda: answered >= before + 20, "traffic after the recovery", 10)
        stop.set()
        await bounded(asyncio.gather(*clients), "the clients to stop", 10)
        assert not failed, failed[:3]
        assert answered > 50
        assert pool.dead == {1}
        assert set(await svc.where.fanout()) == {workers[0].pid}  # both replicas on the live host
    finally:
        if svc is not None:
            await svc.shutdown()
        for w in workers:
            w.kill()
            w.wait(10)
        # The dead host's replica process must not linger as an orphan.
        for proc in psutil.process_iter(["cmdline"]):
            cmd = " ".join(proc.info["cmdline"] or [])
            assert not any(a.rsplit(":", 1)[1] in cmd for a in addresses), cmd
