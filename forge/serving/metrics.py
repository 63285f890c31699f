"""``GET /metrics``: the front door and its policy service in Prometheus' text format.

Per replica (label ``replica``): its state, requests in flight, and per endpoint the service's
own counts (requests, errors, batches, mean batch size, mean queue wait: ``Service.metrics``);
and the engine's (``Policy.engine_counters``): prompt tokens, how many of them the prefix cache
held, the prefill it computed, tokens generated, requests cancelled; with LoRA adapters, the
adapters loaded and evicted, and the batches whose adapter was loaded already or not. For the server: responses by
HTTP status, prompt and completion tokens served, requests waiting for the service now, cancels.
A replica that does not answer within ``ENGINE_TIMEOUT_S`` leaves its engine's counters out of
that scrape (the service's own are always there).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from forge.describe import describe
from forge.types import PackedGroup

__all__ = ["FrontCounts", "prometheus_text"]

logger = logging.getLogger("forge.serving")

ENGINE_TIMEOUT_S = 5.0

_ENGINE = {
    "prompt_tokens": "Prompt tokens of the requests the engine finished",
    "cached_prompt_tokens": "Prompt tokens the engine's prefix cache held (not computed again)",
    "computed_prompt_tokens": "Prompt tokens the engine computed (prefill)",
    "generated_tokens": "Tokens the engine sampled",
    "requests": "Requests the engine finished",
    "cancelled": "Requests cancelled while they ran (their client left)",
}


_MODELS = {
    "loads": "Adapters loaded into the replica's engine",
    "evictions": "Adapters evicted to make room for another",
    "hits": "Batches whose adapter was loaded already",
    "misses": "Batches that had to load their adapter first",
}


@dataclass
class FrontCounts:
    """What the front door answered since it started."""

    responses: Counter[int] = field(default_factory=Counter)
    """HTTP status -> responses (a stream that ends with an error event counts as that error)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cancelled: int = 0
    """Requests whose client left before the answer."""

    def answered(self, status: int) -> None:
        self.responses[status] += 1

    def served(self, group: PackedGroup, prompt_tokens: int) -> None:
        self.answered(200)
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += int(group.token_ids.numel())  # every completion's, flat


async def prometheus_text(policy: Any, counts: FrontCounts, waiting: int) -> bytes:
    """One scrape: the service's metrics now, and each healthy replica's engine counters."""
    from prometheus_client import CollectorRegistry, generate_latest

    service = policy.metrics()
    try:
        engines = await policy.engine_counters.fanout(timeout=ENGINE_TIMEOUT_S, by_replica=True)
    except Exception as exc:  # noqa: BLE001 - a scrape still reports what the controller knows
        logger.info("the policy replicas' engine counters are left out of this scrape: %s", describe(exc))
        engines = {}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(service, engines, counts, waiting))
    return generate_latest(registry)


class _Snapshot:
    """A Prometheus collector over one scrape's numbers."""

    def __init__(self, service: dict[str, Any], engines: dict[int, dict[str, int]], counts: FrontCounts, waiting: int):
        self.service, self.engines, self.counts, self.waiting = service, engines, counts, waiting

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        replicas = self.service["replicas"]
        up = GaugeMetricFamily("forge_replica_up", "1 if the replica takes traffic", labels=["replica", "state"])
        in_flight = GaugeMetricFamily("forge_replica_in_flight", "Requests the replica holds now", labels=["replica"])
        per_endpoint = {
            "requests": CounterMetricFamily(
                "forge_requests", "Requests sent to the replica", labels=["replica", "endpoint"]
            ),
            "errors": CounterMetricFamily(
                "forge_request_errors", "Requests that failed", labels=["replica", "endpoint"]
            ),
            "batches": CounterMetricFamily("forge_batches", "Messages (batches) sent", labels=["replica", "endpoint"]),
        }
        means = {
            "mean_batch_size": GaugeMetricFamily(
                "forge_batch_size_mean", "Mean requests per batch", labels=["replica", "endpoint"]
            ),
            "max_batch_size": GaugeMetricFamily(
                "forge_batch_size_max", "Largest batch so far", labels=["replica", "endpoint"]
            ),
            "mean_queue_wait_s": GaugeMetricFamily(
                "forge_queue_wait_seconds_mean",
                "Mean time a request waited for its batch",
                labels=["replica", "endpoint"],
            ),
        }
        for replica_id, replica in replicas.items():
            label = str(replica_id)
            up.add_metric([label, replica["state"]], 1.0 if replica["state"] == "healthy" else 0.0)
            in_flight.add_metric([label], replica["in_flight"])
            for endpoint, stats in replica["endpoints"].items():
                for key, family in (*per_endpoint.items(), *means.items()):
                    family.add_metric([label, endpoint], stats.get(key, 0))
        yield up
        yield in_flight
        yield from per_endpoint.values()
        yield from means.values()
        for key, help_text in _ENGINE.items():
            family = CounterMetricFamily(f"forge_engine_{key}", help_text, labels=["replica"])
            for replica_id, engine in self.engines.items():
                family.add_metric([str(replica_id)], engine.get(key, 0))
            yield family
        for key, help_text in _MODELS.items():  # a multi-adapter policy: what its multiplexing did
            family = CounterMetricFamily(f"forge_model_{key}", help_text, labels=["replica"])
            for replica_id, replica in replicas.items():
                if "models" in replica:
                    family.add_metric([str(replica_id)], replica["models"].get(key, 0))
            yield family
        yield CounterMetricFamily(
            "forge_service_retried", "Requests sent again after their replica died", self.service["retried"]
        )
        yield CounterMetricFamily("forge_service_restarts", "Replica restarts", self.service["restarts"])
        responses = CounterMetricFamily("forge_http_responses", "Responses by HTTP status", labels=["status"])
        for status, n in sorted(self.counts.responses.items()):
            responses.add_metric([str(status)], n)
        yield responses
        yield CounterMetricFamily(
            "forge_http_prompt_tokens", "Prompt tokens of the requests served", self.counts.prompt_tokens
        )
        yield CounterMetricFamily(
            "forge_http_completion_tokens", "Completion tokens served", self.counts.completion_tokens
        )
        yield CounterMetricFamily("forge_http_cancelled", "Requests whose client left first", self.counts.cancelled)
        yield GaugeMetricFamily("forge_http_waiting", "Requests waiting for the policy service now", self.waiting)
