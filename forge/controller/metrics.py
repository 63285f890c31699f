"""A service's metrics: replicas report sums, the service adds them up and derives every mean once.

Per replica and endpoint the sums are ``BatchStats``' fields (a plain endpoint's message counts
as a batch of one) plus requests in flight; ``endpoint_view`` turns sums into what a caller of
``svc.metrics()`` reads (mean batch size and mean queue wait in place of the totals), and
``aggregate_endpoints`` adds replicas up first, so a mean is never a mean of means.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from forge.controller.batching import Batcher, BatchStats
from forge.controller.model_cache import aggregate_metrics, models_view

if TYPE_CHECKING:
    from forge.controller.replica import Replica

_SUMMED = ("requests", "batches", "items_batched", "queue_wait_s_total", "in_flight", "errors")


@dataclass
class EndpointCounters:
    """One endpoint's request counts on one replica (its batcher, if any, counts batches)."""

    requests: int = 0
    errors: int = 0
    in_flight: int = 0
    messages: int = 0


def endpoint_sums(counters: EndpointCounters, batcher: Batcher | None) -> dict[str, Any]:
    """One endpoint's sums on one replica: its batcher's stats, or its messages as batches of one."""
    if batcher is not None:
        stats = dataclasses.asdict(batcher.stats) | {"queued": batcher.queued, "open_keys": len(batcher.keys)}
    else:
        one_per_message = BatchStats(
            requests=counters.requests,
            batches=counters.messages,
            items_batched=counters.messages,
            max_batch_size=min(counters.messages, 1),
            errors=counters.errors,
        )
        stats = dataclasses.asdict(one_per_message)
    return {**stats, "in_flight": counters.in_flight}


def aggregate_endpoints(replica_endpoints: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per endpoint, the replicas' sums (``Replica.metrics()["endpoints"]``) added up, with the
    means computed from the totals (never a mean of means)."""
    totals: dict[str, dict[str, Any]] = {}
    for endpoints in replica_endpoints:
        for name, sums in endpoints.items():
            total = totals.setdefault(name, dict.fromkeys(_SUMMED, 0) | {"max_batch_size": 0})
            for key in _SUMMED:
                total[key] += sums[key]
            total["max_batch_size"] = max(total["max_batch_size"], sums["max_batch_size"])
    return {name: endpoint_view(total) for name, total in totals.items()}


def endpoint_view(sums: dict[str, Any]) -> dict[str, Any]:
    """An endpoint's metrics as reported: its sums, with mean batch size and mean queue wait
    in place of the item and wait totals."""
    items = sums["items_batched"]
    view = {k: v for k, v in sums.items() if k not in ("items_batched", "queue_wait_s_total")}
    view["mean_batch_size"] = items / sums["batches"] if sums["batches"] else 0.0
    view["mean_queue_wait_s"] = sums["queue_wait_s_total"] / items if items else 0.0
    return view


def service_metrics(name: str, replicas: Sequence[Replica], retried: int, multiplexed: bool) -> dict[str, Any]:
    """``svc.metrics()``: per replica and per endpoint, and the endpoints over all replicas;
    with multiplexed endpoints, ``models`` too (``forge.controller.model_cache``)."""
    sums = {r.replica_id: r.metrics() for r in replicas}
    per_replica = {}
    for replica_id, rm in sums.items():
        per_replica[replica_id] = {**rm, "endpoints": {ep: endpoint_view(st) for ep, st in rm["endpoints"].items()}}
        if "models" in rm:
            per_replica[replica_id]["models"] = models_view(rm["models"])
    result = {
        "service": name,
        "replicas": per_replica,
        "endpoints": aggregate_endpoints([rm["endpoints"] for rm in sums.values()]),
        "retried": retried,
        "restarts": sum(r.restarts for r in replicas),
    }
    if multiplexed:
        result["models"] = aggregate_metrics([rm["models"] for rm in sums.values() if "models" in rm])
    return result
