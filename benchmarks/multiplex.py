"""Model multiplexing: model-aware routing vs round robin on a Zipf-distributed stream of models.

    python benchmarks/multiplex.py [--out results.json] [--requests 2000] [--models 12] [--replicas 3]

``--clients`` callers in a closed loop send ``--requests`` requests whose model ids follow a
Zipf law (exponent ``--zipf``) over ``--models`` models, to ``--replicas`` replicas holding at
most ``--max-models`` models each. The same seeded stream runs twice, on fresh services: with
``model_aware`` routing (the default of multiplexed endpoints) and with plain ``round_robin``.

Cost model, stated in the output: loading a model holds the replica's process for
``--load-ms`` (``time.sleep``, like reading and deserialising a small checkpoint; default
50 ms); a batch takes 2 ms + 0.1 ms per item (``asyncio.sleep``: with 2 shared CPU cores,
spinning replicas would measure the machine, not the routing). Reports, per router:
throughput, loads and evictions per 1,000 requests, hit rate, mean batch size, latency
percentiles; and ``aware_vs_round_robin_throughput``, ``loads_per_1k_aware``,
``loads_per_1k_round_robin``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import forge.controller
from forge.controller import Batching, ForgeActor, endpoint, model_loader

BATCH_FIXED_S = 0.002
BATCH_PER_ITEM_S = 0.0001
MAX_BATCH = 16


class SimulatedModels(ForgeActor):
    """Models that cost ``load_s`` to load and a fixed + per-item time per batch."""

    def __init__(self, load_s: float):
        self.load_s = load_s

    @model_loader  # the capacity is the service's options(max_models=...)
    async def load_model(self, model_id: str) -> str:
        time.sleep(self.load_s)  # blocking on purpose: a checkpoint read holds the process
        return model_id

    @endpoint(batch=Batching(max_size=MAX_BATCH, max_wait_s=0.005), multiplexed=True)
    async def predict(self, model: str, items: list) -> list:
        await asyncio.sleep(BATCH_FIXED_S + BATCH_PER_ITEM_S * len(items))
        return [model] * len(items)


def zipf_stream(n_requests: int, n_models: int, s: float, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(n_models)]
    return [f"m{k}" for k in rng.choices(range(n_models), weights, k=n_requests)]


async def run(router: str, stream: list[str], args: argparse.Namespace) -> dict[str, float]:
    options = {"num_replicas": args.replicas, "max_models": args.max_models, "router": router}
    svc = await SimulatedModels.options(**options).as_service(load_s=args.load_ms / 1e3)
    try:
        todo = iter(enumerate(stream))
        latencies: list[float] = []

        async def client() -> None:
            for i, model_id in todo:
                t = time.perf_counter()
                served_by = await svc.predict.route(i, model_id=model_id)
                latencies.append(time.perf_counter() - t)
                assert served_by == model_id, (served_by, model_id)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.clients)))
        elapsed = time.perf_counter() - t0
        m = svc.metrics()["models"]
    finally:
        await svc.shutdown()
    per_model = m["per_model"].values()
    batches = sum(p["batches"] for p in per_model)
    items = sum(p["mean_batch_size"] * p["batches"] for p in per_model)
    latencies.sort()
    return {
        "throughput_rps": len(stream) / elapsed,
        "seconds": elapsed,
        "loads": m["loads"],
        "loads_per_1k": 1000 * m["loads"] / len(stream),
        "evictions_per_1k": 1000 * m["evictions"] / len(stream),
        "hit_rate": m["hit_rate"],
        "mean_batch_size": items / batches if batches else 0.0,
        "p50_ms": 1e3 * latencies[len(latencies) // 2],
        "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))],
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--requests", type=int, default=2000, help="requests in the stream")
    parser.add_argument("--models", type=int, default=12, help="distinct model ids (N)")
    parser.add_argument("--replicas", type=int, default=3, help="replicas (M)")
    parser.add_argument("--max-models", type=int, default=3, help="models one replica holds at most")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of model popularity")
    parser.add_argument("--clients", type=int, default=32, help="concurrent callers (closed loop)")
    parser.add_argument("--load-ms", type=float, default=50.0, help="cost of one model load, in ms")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    stream = zipf_stream(args.requests, args.models, args.zipf, args.seed)
    aware = await run("model_aware", stream, args)
    round_robin = await run("round_robin", stream, args)
    results = {
        "setup": {
            "requests": args.requests,
            "models": args.models,
            "replicas": args.replicas,
            "max_models_per_replica": args.max_models,
            "zipf_exponent": args.zipf,
            "clients": args.clients,
            "hottest_model_share": stream.count("m0") / len(stream),
            "load_cost": f"{args.load_ms:g} ms per model load (blocking sleep in the replica's process)",
            "batch_cost": (
                f"{BATCH_FIXED_S * 1e3:g} ms + {BATCH_PER_ITEM_S * 1e3:g} ms per item (async sleep), "
                f"max_size {MAX_BATCH}"
            ),
        },
        "model_aware": aware,
        "round_robin": round_robin,
        "aware_vs_round_robin_throughput": aware["throughput_rps"] / round_robin["throughput_rps"],
        "loads_per_1k_aware": aware["loads_per_1k"],
        "loads_per_1k_round_robin": round_robin["loads_per_1k"],
    }
    print(f"{'':28s} {'model_aware':>12s} {'round_robin':>12s}")
    for key in aware:
        print(f"{key:28s} {aware[key]:12.2f} {round_robin[key]:12.2f}")
    print(
        f"aware_vs_round_robin_throughput {results['aware_vs_round_robin_throughput']:.2f}x; "
        f"{results['setup']['load_cost']}; batch: {results['setup']['batch_cost']}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    forge.controller.quiet_monarch()
    asyncio.run(main())
