"""Replicas report sums; the service adds them up and computes every mean once (plain logic)."""

from forge.controller.metrics import aggregate_endpoints, endpoint_view
from forge.controller.model_cache import aggregate_metrics


def sums(requests, batches, items, wait_total, max_size, in_flight=0, errors=0):
    return {
        "requests": requests,
        "batches": batches,
        "items_batched": items,
        "queue_wait_s_total": wait_total,
        "max_batch_size": max_size,
        "in_flight": in_flight,
        "errors": errors,
    }


def test_service_means_weigh_each_item_not_each_replica():
    """One replica ran a batch of 8 (each item waited 0.1 s), another 3 batches of 1 (no wait):
    the mean batch size is 11 items / 4 batches, not the mean of 8 and 1."""
    busy, idle = sums(8, 1, 8, 0.8, 8, in_flight=2), sums(3, 3, 3, 0.0, 1, errors=1)
    total = aggregate_endpoints([{"score": busy}, {"score": idle}])["score"]
    assert total["mean_batch_size"] == 11 / 4
    assert abs(total["mean_queue_wait_s"] - 0.8 / 11) < 1e-12
    assert (total["requests"], total["batches"], total["max_batch_size"]) == (11, 4, 8)
    assert (total["in_flight"], total["errors"]) == (2, 1)
    assert "items_batched" not in total and "queue_wait_s_total" not in total


def test_one_replica_view_and_empty_endpoints():
    view = endpoint_view({**sums(4, 2, 4, 0.2, 3), "queued": 1, "open_keys": 1})
    assert (view["mean_batch_size"], view["queued"], view["open_keys"]) == (2.0, 1, 1)
    assert endpoint_view(sums(0, 0, 0, 0.0, 0))["mean_queue_wait_s"] == 0.0


def test_model_means_come_from_summed_loads_and_items():
    def replica(loads, load_s, hits, misses, batches, items):
        per_model = {"m": {"requests": items, "loads": loads, "batches": batches, "items": items, "max_batch_size": 4}}
        counts = {"loads": loads, "evictions": 0, "hits": hits, "misses": misses, "load_failures": 0}
        return {**counts, "load_s_total": load_s, "per_model": per_model}

    total = aggregate_metrics([replica(1, 0.3, 9, 1, 3, 12), replica(3, 0.1, 0, 4, 1, 1)])
    assert total["mean_load_s"] == 0.4 / 4  # not the mean of 0.3 and 0.1/3
    assert total["hit_rate"] == 9 / 14
    assert total["per_model"]["m"]["mean_batch_size"] == 13 / 4
