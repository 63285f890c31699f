"""Cost per routed item of every built-in router at 2, 64 and 1,024 replicas, side by side.

    python benchmarks/router_scale.py [--out results.json] [--replicas 2,64,1024] [--items 20000]

A controller routes thousands of items a step, and a service may have as many replicas as it
is given, so a router's work per item must not grow with the number of replicas. This drives
the real router classes of ``forge.controller.routing`` in process (no Monarch, no service)
over small replica views that keep the state a router reads, changed by the stream as a
service's replicas would be:

- ``in_flight``: each routed item adds one to its replica; the stream holds 4 items per replica
  in flight, and each arrival once full retires the oldest (steady state, FIFO completion);
- ``has_forming(endpoint, key)``: true while an item of that batch queue is in flight there;
- ``has_model`` / ``num_models`` (``model_aware``): a replica loads a model when one of its
  requests arrives and keeps its 4 most recently used.

The requests are those each router is made for: none for ``round_robin`` and ``least_loaded``;
sessions of 6 turns for ``sticky`` (4 live per replica); for ``key_affinity``, prompt keys (a
fifth from 10 hot prompts, the rest from 10,000) and, for half of them, one of 16 batch queues;
for ``model_aware``, 64 model ids, a few hot (the id is the batch queue too).

Only the ``choose`` call is timed, one call at a time with ``perf_counter_ns``, less the
timer's own cost (measured here, and printed); the first ``2 x 4n`` items of each run (the
window filling, the router's first look at the replicas) are not timed. Rounds interleave
replica counts and routers so that a drift in the machine's load hits all; the median round is
reported, with the peak replica load over the mean at the end as a check that routing still
balances.

Reports ``route_us_per_item_1024_vs_2_replicas``: the worst over the built-in routers of the cost
per item at 1,024 replicas over the cost at 2 (goal <= 1.5), with each router's ratio. Then the
same for the work a real ``Service`` does per request before its router
(``service_candidates_us_1024_vs_2_replicas``: listing the healthy replicas with room).
Run it on an older checkout's ``forge`` (``PYTHONPATH=old/checkout``) to compare.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Hashable, Iterator

import forge.controller.routing as routing
from forge.controller.routing import Router, RouteRequest

IN_FLIGHT_PER_REPLICA = 4
MODELS_PER_REPLICA = 4
ENDPOINT = "generate"


class View:
    """One replica as a router sees it (the ``ReplicaView`` / ``ModelReplicaView`` protocols)."""

    def __init__(self, replica_id: int) -> None:
        self.replica_id = replica_id
        self.in_flight = 0
        self.forming: collections.Counter[tuple[str, Hashable]] = collections.Counter()
        self.models: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    def has_forming(self, endpoint: str, key: Hashable) -> bool:
        return self.forming[(endpoint, key)] > 0

    def has_model(self, model_id: Hashable) -> bool:
        return model_id in self.models

    @property
    def num_models(self) -> int:
        return len(self.models)

    def take(self, request: RouteRequest) -> None:
        """The request arrives: it is in flight, its batch forms, its model is (re)loaded."""
        self.in_flight += 1
        self.forming[(request.endpoint, request.batch_key)] += 1
        if request.endpoint == "model" and request.key is not None:
            self.models[request.key] = None
            self.models.move_to_end(request.key)
            if len(self.models) > MODELS_PER_REPLICA:
                self.models.popitem(last=False)

    def finish(self, request: RouteRequest) -> None:
        self.in_flight -= 1
        self.forming[(request.endpoint, request.batch_key)] -= 1


# ------------------------------------------------------------------ request streams
def no_keys(rng: random.Random, n: int) -> Iterator[RouteRequest]:
    while True:
        yield RouteRequest(ENDPOINT)


def sessions(rng: random.Random, n: int) -> Iterator[RouteRequest]:
    """Turns of live sessions (4 per replica); a session ends after 6 turns and a new one starts."""
    live = [[f"s{i}", 0] for i in range(IN_FLIGHT_PER_REPLICA * n)]
    started = len(live)
    while True:
        session = rng.choice(live)
        session[1] += 1
        if session[1] > 6:
            session[0], session[1] = f"s{started}", 1
            started += 1
        yield RouteRequest(ENDPOINT, session[0])


def prompts(rng: random.Random, n: int) -> Iterator[RouteRequest]:
    """Prompt keys, a fifth of them hot; half name one of 16 batch queues."""
    while True:
        key = f"hot-{rng.randrange(10)}" if rng.random() < 0.2 else f"prompt-{rng.randrange(10_000)}"
        batch_key = f"bucket-{rng.randrange(16)}" if rng.random() < 0.5 else None
        yield RouteRequest(ENDPOINT, key, batch_key)


def models(rng: random.Random, n: int) -> Iterator[RouteRequest]:
    """64 model ids with a Zipf-like skew; the model id is also the batch queue."""
    weights = [1 / (rank + 1) for rank in range(64)]
    while True:
        model_id = f"model-{rng.choices(range(64), weights)[0]}"
        yield RouteRequest("model", model_id, model_id)


ROUTERS: dict[str, tuple[Callable[[], Router], Callable[[random.Random, int], Iterator[RouteRequest]]]] = {
    "round_robin": (routing.RoundRobin, no_keys),
    "least_loaded": (lambda: routing.LeastLoaded(seed=0), no_keys),
    "sticky": (lambda: routing.Sticky(seed=0), sessions),
    "key_affinity": (lambda: routing.KeyAffinity(seed=0), prompts),
    "model_aware": (lambda: routing.ModelAware(seed=0), models),
}


def timer_overhead_ns(samples: int = 200_000) -> float:
    """The cost of one empty timed region, subtracted from every timed ``choose``."""
    clock = time.perf_counter_ns
    total = 0
    for _ in range(samples):
        t0 = clock()
        total += clock() - t0
    return total / samples


def run_once(name: str, num_replicas: int, items: int, overhead_ns: float) -> tuple[float, float]:
    """µs per routed item (timed items only) and the peak load over the mean at the end."""
    make, stream = ROUTERS[name]
    router = make()
    rng = random.Random(0)
    replicas = [View(i) for i in range(num_replicas)]
    requests = stream(rng, num_replicas)
    window = IN_FLIGHT_PER_REPLICA * num_replicas
    in_flight: collections.deque[tuple[View, RouteRequest]] = collections.deque()
    clock, warmup, timed_ns = time.perf_counter_ns, 2 * window, 0
    for i in range(warmup + items):
        request = next(requests)
        t0 = clock()
        chosen = router.choose(request, replicas)
        elapsed = clock() - t0
        if i >= warmup:
            timed_ns += elapsed
        chosen.take(request)  # type: ignore[attr-defined]
        in_flight.append((chosen, request))  # type: ignore[arg-type]
        if len(in_flight) > window:
            view, done = in_flight.popleft()
            view.finish(done)
    peak = max(r.in_flight for r in replicas) / (window / num_replicas)
    return (timed_ns / items - overhead_ns) / 1e3, peak


def service_candidates_us(num_replicas: int, items: int, overhead_ns: float) -> float:
    """µs per request of a real ``Service``'s own look at its replicas before its router's
    (``_candidates``: the healthy ones with room), over ``num_replicas`` unstarted replicas
    marked healthy; one replica fails and recovers every 1,000 requests, so the cached list is
    rebuilt as a service's would be."""
    from forge.controller import ForgeActor, ReplicaState, endpoint
    from forge.controller.service import Service

    class Echo(ForgeActor):
        @endpoint
        async def echo(self, x: int) -> int:
            return x

    service = Service(Echo, Echo.options(num_replicas=num_replicas).options, (), {})
    for replica in service.replicas:
        replica.state = ReplicaState.HEALTHY
    clock, timed_ns, flapping = time.perf_counter_ns, 0, service.replicas[-1]
    for i in range(items):
        if i % 1000 == 0:
            flapping.state = ReplicaState.FAILED if flapping.state is ReplicaState.HEALTHY else ReplicaState.HEALTHY
        t0 = clock()
        service._candidates(set())
        timed_ns += clock() - t0
    return (timed_ns / items - overhead_ns) / 1e3


def measure(replica_counts: list[int], items: int, rounds: int) -> tuple[dict, dict, float]:
    overhead = timer_overhead_ns()
    costs: dict[str, dict[int, list[float]]] = {name: {n: [] for n in replica_counts} for name in ROUTERS}
    peaks: dict[str, dict[int, float]] = {name: {} for name in ROUTERS}
    for _ in range(rounds):
        for n in replica_counts:
            for name in ROUTERS:
                us, peak = run_once(name, n, items, overhead)
                costs[name][n].append(us)
                peaks[name][n] = peak
    medians = {name: {n: statistics.median(s) for n, s in by_n.items()} for name, by_n in costs.items()}
    return medians, peaks, overhead


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--replicas", default="2,64,1024", help="comma-separated replica counts (2 and 1024 always)")
    parser.add_argument("--items", type=int, default=20_000, help="timed items per router, replica count and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args()
    replica_counts = sorted({2, 1024, *(int(n) for n in args.replicas.split(","))})
    costs, peaks, overhead = measure(replica_counts, args.items, args.rounds)

    print(f"timer overhead subtracted: {overhead:.0f} ns per item")
    print(f"{'router':>14}" + "".join(f"{f'{n} replicas':>15}" for n in replica_counts) + f"{'1024 vs 2':>11}")
    ratios = {name: by_n[1024] / by_n[2] for name, by_n in costs.items()}
    for name, by_n in costs.items():
        cells = "".join(f"{by_n[n]:>12.2f} us" for n in replica_counts)
        print(f"{name:>14}{cells}{ratios[name]:>11.2f}")
    worst = max(ratios.values())
    print(f"route_us_per_item_1024_vs_2_replicas = {worst:.2f} (worst: {max(ratios, key=ratios.get)}; goal <= 1.5)")
    print("peak load / mean at the end: " + ", ".join(f"{name} {peaks[name][1024]:.2f}" for name in ROUTERS))
    overhead_ns = timer_overhead_ns()
    candidates = {
        n: statistics.median(service_candidates_us(n, args.items, overhead_ns) for _ in range(args.rounds))
        for n in (2, 1024)
    }
    candidates_ratio = candidates[1024] / max(candidates[2], 1e-3)
    print(
        f"service candidates: {candidates[2]:.2f} us at 2 replicas, {candidates[1024]:.2f} us at 1024 "
        f"(service_candidates_us_1024_vs_2_replicas = {candidates_ratio:.2f})"
    )
    result = {
        "service_candidates_us": {str(n): us for n, us in candidates.items()},
        "service_candidates_us_1024_vs_2_replicas": candidates_ratio,
        "route_us_per_item_1024_vs_2_replicas": worst,
        "route_us_per_item_1024_vs_2_replicas_by_router": ratios,
        "route_us_per_item": {name: {str(n): us for n, us in by_n.items()} for name, by_n in costs.items()},
        "peak_load_over_mean": {name: {str(n): p for n, p in by_n.items()} for name, by_n in peaks.items()},
        "timer_overhead_ns": overhead,
        "items": args.items,
        "rounds": args.rounds,
        "in_flight_per_replica": IN_FLIGHT_PER_REPLICA,
        "forge_routing": routing.__file__,
        "load_average_1m": os.getloadavg()[0],
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
