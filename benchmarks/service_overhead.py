"""Service-layer overhead and prebatching gains, measured side by side in one run.

    python benchmarks/service_overhead.py [--out results.json] [--items 2000]

Reports three ratios (the goals are those of the service-core issue):

- ``route_vs_call_one_latency``: median latency of ``svc.ep.route(x)`` through a 1-replica
  service to a plain endpoint / raw Monarch ``call_one`` to the same kind of actor (goal <= 1.05).
  The two alternate in short blocks, each first in every other round, so that both see the
  same machine (this machine's speed drifts by more than the overhead measured); the JSON also
  has the spread of the rounds' own ratios.
- ``prebatch_vs_caller_batch_throughput``: N concurrent singleton ``route`` calls to a batched
  endpoint (cost: a fixed few ms per call plus a little per item, CPU-bound like a forward
  pass) / the same items sent by the caller as ready-made batches of ``max_size`` (goal >= 0.98).
- ``prebatch_vs_unbatched_throughput``: the same singletons with prebatching / one message per
  item to a plain endpoint of the same cost model (goal >= 5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import forge.controller  # before monarch (see forge.controller's docstring)
from forge.controller import Batching, ForgeActor, endpoint

# isort: split
from monarch.actor import Actor, this_host
from monarch.actor import endpoint as monarch_endpoint

FIXED_COST_S = 0.003
PER_ITEM_COST_S = 0.00005
MAX_SIZE = 32


def busy(seconds: float) -> None:
    """Hold the CPU like a model forward would (sleeping would let batches overlap for free)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def work(n: int) -> None:
    busy(FIXED_COST_S + PER_ITEM_COST_S * n)


class RawEcho(Actor):
    @monarch_endpoint
    async def echo(self, x: int) -> int:
        return x


class Model(ForgeActor):
    @endpoint
    async def echo(self, x: int) -> int:
        return x

    @endpoint(batch=Batching(max_size=MAX_SIZE, max_wait_s=0.005, max_concurrent_batches=2))
    async def forward(self, items: list[int]) -> list[int]:
        work(len(items))
        return [x + 1 for x in items]

    @endpoint
    async def forward_list(self, items: list[int]) -> list[int]:
        """Caller batching: the caller sends ready-made batches."""
        work(len(items))
        return [x + 1 for x in items]

    @endpoint
    async def forward_one(self, item: int) -> int:
        work(1)
        return item + 1


async def measure_latency(rounds: int = 30, per_round: int = 100) -> dict[str, float]:
    svc = await Model.options(num_replicas=1).as_service()
    procs = this_host().spawn_procs(per_host={"procs": 1}, name="raw")
    raw = procs.spawn("raw", RawEcho)
    await raw.echo.call_one(0)
    await svc.echo.route(0)
    calls = {"route": svc.echo.route, "call_one": raw.echo.call_one}
    seconds: dict[str, list[float]] = {"route": [], "call_one": []}
    round_ratios = []
    for round_ in range(rounds):  # interleaved, so both see the same machine state
        order = ("route", "call_one") if round_ % 2 == 0 else ("call_one", "route")
        medians = {}
        for name in order:
            call, block = calls[name], []
            for i in range(per_round):
                t = time.perf_counter()
                await call(i)
                block.append(time.perf_counter() - t)
            seconds[name].extend(block)
            medians[name] = statistics.median(block)
        round_ratios.append(medians["route"] / medians["call_one"])
    await svc.shutdown()
    await procs.stop()
    route_med, raw_med = statistics.median(seconds["route"]), statistics.median(seconds["call_one"])
    return {
        "route_median_ms": route_med * 1e3,
        "call_one_median_ms": raw_med * 1e3,
        "route_vs_call_one_latency": route_med / raw_med,
        "round_ratio_min": min(round_ratios),
        "round_ratio_max": max(round_ratios),
    }


async def measure_throughput(n_items: int, rounds: int = 3) -> dict[str, float]:
    """Each mode ``rounds`` times, interleaved; the median time of each counts."""
    svc = await Model.options(num_replicas=1).as_service()
    items = list(range(n_items))
    expected = [x + 1 for x in items]
    chunks = [items[i : i + MAX_SIZE] for i in range(0, n_items, MAX_SIZE)]
    await svc.forward.route_many(items[:64])  # warm up
    await svc.forward_list.route(items[:MAX_SIZE])

    async def prebatched() -> None:
        assert await asyncio.gather(*(svc.forward.route(x) for x in items)) == expected

    async def caller_batched() -> None:
        results = await asyncio.gather(*(svc.forward_list.route(c) for c in chunks))
        assert [y for r in results for y in r] == expected

    async def unbatched() -> None:
        assert await asyncio.gather(*(svc.forward_one.route(x) for x in items)) == expected

    times: dict[str, list[float]] = {"prebatched": [], "caller": [], "unbatched": []}
    for round_ in range(rounds):
        for name, run in (("prebatched", prebatched), ("caller", caller_batched), ("unbatched", unbatched)):
            if name == "unbatched" and round_ > 0:
                continue  # ~20x slower; one round says enough
            t = time.perf_counter()
            await run()
            times[name].append(time.perf_counter() - t)
    stats = svc.metrics()["endpoints"]["forward"]
    await svc.shutdown()
    pre, caller, single = (statistics.median(times[k]) for k in ("prebatched", "caller", "unbatched"))
    return {
        "items": n_items,
        "prebatched_items_per_s": n_items / pre,
        "caller_batched_items_per_s": n_items / caller,
        "unbatched_items_per_s": n_items / single,
        "prebatched_mean_batch_size": stats["mean_batch_size"],
        "prebatch_vs_caller_batch_throughput": caller / pre,
        "prebatch_vs_unbatched_throughput": single / pre,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--items", type=int, default=2000, help="singleton requests in the throughput runs")
    args = parser.parse_args()
    results = {**await measure_latency(), **await measure_throughput(args.items)}
    goals = {
        "route_vs_call_one_latency": ("<=", 1.05),
        "prebatch_vs_caller_batch_throughput": (">=", 0.98),
        "prebatch_vs_unbatched_throughput": (">=", 5.0),
    }
    print(f"{'metric':42s} {'value':>10s}  goal")
    for key, value in results.items():
        goal = goals.get(key)
        mark = ""
        if goal:
            ok = value <= goal[1] if goal[0] == "<=" else value >= goal[1]
            mark = f"{goal[0]} {goal[1]}  {'met' if ok else 'MISSED'}"
        print(f"{key:42s} {value:10.3f}  {mark}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    forge.controller.quiet_monarch()
    asyncio.run(main())
