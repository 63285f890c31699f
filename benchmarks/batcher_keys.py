"""Per-item cost of the Batcher as the number of live batching keys grows.

    python benchmarks/batcher_keys.py [--out results.json] [--keys 100,1000,4000,16000]

Multi-turn rollouts key their requests by session, so a replica's Batcher can hold thousands of
live keys at once. This drives the in-process Batcher (no Monarch, no processes) with an
executor that answers at once: for each key count it queues 2 items per key (``max_size=8``, so
no key ever fills a batch and every batch is started by its deadline) and times how long the
whole lot takes to drain. The cost per item is that time over the number of items.

Reports ``per_item_cost_16k_vs_100_keys``: the per-item cost at 16,000 keys over the cost at 100
(goal <= 2: the dispatcher's work per batch must not grow with the number of live keys).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from forge.controller.batching import Batcher, Batching

ITEMS_PER_KEY = 2
MAX_SIZE = 8
MAX_WAIT_S = 0.001


async def _execute(items: list[int], key: object) -> list[int]:
    return items


async def drain_once(num_keys: int) -> float:
    """Seconds to queue and drain ``ITEMS_PER_KEY`` items for each of ``num_keys`` keys."""
    batcher = Batcher(Batching(max_size=MAX_SIZE, max_wait_s=MAX_WAIT_S), _execute, name="bench")
    t0 = time.perf_counter()
    futures = [batcher.enqueue(i, key=f"session-{k}") for k in range(num_keys) for i in range(ITEMS_PER_KEY)]
    results = await asyncio.gather(*futures)
    elapsed = time.perf_counter() - t0
    assert len(results) == num_keys * ITEMS_PER_KEY
    assert batcher.stats.batches == num_keys, "every key should drain as one batch"
    await batcher.close()
    return elapsed


async def measure(key_counts: list[int], rounds: int) -> dict[int, float]:
    """Median per-item cost (seconds) per key count, rounds interleaved so load drifts hit all."""
    samples: dict[int, list[float]] = {n: [] for n in key_counts}
    for _ in range(rounds):
        for n in key_counts:
            samples[n].append(await drain_once(n) / (n * ITEMS_PER_KEY))
    return {n: statistics.median(s) for n, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--keys", default="100,1000,4000,16000", help="comma-separated live key counts")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args()
    key_counts = sorted({int(k) for k in args.keys.split(",")})
    for needed in (100, 16000):
        if needed not in key_counts:
            key_counts.append(needed)
    key_counts.sort()
    costs = asyncio.run(measure(key_counts, args.rounds))
    print(f"{'live keys':>10}  {'cost per item':>14}")
    for n in key_counts:
        print(f"{n:>10}  {costs[n] * 1e6:>11.1f} us")
    ratio = costs[16000] / costs[100]
    print(f"per_item_cost_16k_vs_100_keys = {ratio:.2f} (goal <= 2)")
    result = {
        "per_item_cost_16k_vs_100_keys": ratio,
        "per_item_cost_us": {str(n): costs[n] * 1e6 for n in key_counts},
        "items_per_key": ITEMS_PER_KEY,
        "max_size": MAX_SIZE,
        "max_wait_s": MAX_WAIT_S,
        "rounds": args.rounds,
        "load_average_1m": os.getloadavg()[0],
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
