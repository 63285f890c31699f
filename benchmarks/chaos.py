"""Chaos report: a replica is SIGKILLed under load; count what every request got.

    python benchmarks/chaos.py [--out chaos.json] [--requests 3000] [--replicas 3]

A closed stream of singleton requests (prebatched) goes to a service of N replicas; one
replica's process is killed from outside part-way through. Writes JSON with ``requests``,
``ok``, ``retried``, ``failed_clear`` (a forge error naming what happened), ``lost`` (no answer
and no error, or a wrong answer: must be 0), ``hung`` (still waiting at the end: must be 0)
and ``recovery_s`` (from the kill until the restarted replica served a request again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

import forge.controller
from forge.controller import Batching, ForgeActor, ForgeError, ReplicaState, endpoint


class Worker(ForgeActor):
    @endpoint(batch=Batching(max_size=16, max_wait_s=0.005))
    async def work(self, items: list[int]) -> list[int]:
        await asyncio.sleep(0.003)
        return [x * 2 for x in items]

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


async def run(n_requests: int, n_replicas: int, duration_s: float) -> dict:
    svc = await Worker.options(num_replicas=n_replicas, router="least_loaded", restart_backoff_s=0.2).as_service()
    victim = svc.service.replicas[n_replicas // 2]
    victim_pid = await victim.call("pid", (), {}, 10)

    async def one(i: int) -> int:
        await asyncio.sleep(duration_s * i / n_requests)
        return await svc.work.route(i)

    tasks = [asyncio.ensure_future(one(i)) for i in range(n_requests)]
    await asyncio.sleep(duration_s / 3)
    killed_at = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)

    recovery_s = None
    while time.monotonic() - killed_at < 60:
        if victim.generation >= 1 and victim.state is ReplicaState.HEALTHY:
            await victim.submit("work", 1, None, 10)  # it serves again
            recovery_s = time.monotonic() - killed_at
            break
        await asyncio.sleep(0.02)

    done, pending = await asyncio.wait(tasks, timeout=120)
    for task in pending:
        task.cancel()
    ok = failed_clear = lost = 0
    for i, task in enumerate(tasks):
        if task in pending:
            continue
        exc = task.exception()
        if exc is None:
            ok += task.result() == 2 * i
            lost += task.result() != 2 * i
        elif isinstance(exc, ForgeError):
            failed_clear += 1
        else:
            lost += 1
    metrics = svc.metrics()
    await svc.shutdown()
    return {
        "requests": n_requests,
        "ok": ok,
        "retried": metrics["retried"],
        "failed_clear": failed_clear,
        "lost": lost,
        "hung": len(pending),
        "recovery_s": recovery_s,
        "restarts": metrics["restarts"],
        "replicas": n_replicas,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the report as JSON to this file")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds over which requests are sent")
    args = parser.parse_args()
    report = asyncio.run(run(args.requests, args.replicas, args.duration))
    for key, value in report.items():
        print(f"{key:14s} {value}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if report["lost"] or report["hung"]:
        raise SystemExit("requests were lost or hung")


if __name__ == "__main__":
    forge.controller.quiet_monarch()
    main()
