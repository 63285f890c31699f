"""MetricAggregator reductions and the process-local record/drain pair."""

import math

import pytest
import torch

from forge.observability import REDUCTIONS, MetricAggregator, drain_local_metrics, record_metric


@pytest.mark.parametrize(
    "reduce, expected",
    [("mean", 2.0), ("sum", 6.0), ("max", 3.0), ("min", 1.0), ("last", 2.0)],
)
def test_flush_reduces_each_metric_with_its_reduction(reduce, expected):
    """Values 1, 3, 2 reduce to mean 2, sum 6, max 3, min 1, last 2."""
    agg = MetricAggregator()
    for v in (1.0, 3.0, 2.0):
        agg.record("x", v, reduce)
    assert agg.flush(step=0) == {"x": expected}


def test_flush_clears_so_each_step_starts_empty():
    """A second flush without new records is empty; new records only count in their step."""
    agg = MetricAggregator()
    agg.record("loss", 4.0)
    assert agg.flush(1) == {"loss": 4.0}
    assert agg.flush(2) == {}
    agg.record("loss", 1.0)
    assert agg.flush(3) == {"loss": 1.0}


def test_several_metrics_reduce_independently():
    """Each name keeps its own values and reduction."""
    agg = MetricAggregator()
    agg.record("reward_mean", 0.5)
    agg.record("reward_mean", 1.0)
    agg.record("tokens", 10, "sum")
    agg.record("tokens", 5, "sum")
    assert agg.flush(0) == {"reward_mean": 0.75, "tokens": 15.0}


def test_one_element_tensors_are_accepted():
    """A 0-d or 1-element tensor is recorded as its float value."""
    agg = MetricAggregator()
    agg.record("kl", torch.tensor(0.25))
    agg.record("kl", torch.tensor([0.75]))
    assert agg.flush(0) == {"kl": 0.5}


def test_multi_element_tensor_is_refused_with_its_shape():
    """A whole tensor is not a metric value: the error names the metric and the shape."""
    with pytest.raises(ValueError, match=r"'kl'.*\(3,\)"):
        MetricAggregator().record("kl", torch.zeros(3))


@pytest.mark.parametrize("value", ["1.0", None, True])
def test_non_numeric_values_are_refused(value):
    """Strings, None and bools are TypeErrors naming the metric."""
    with pytest.raises(TypeError, match="'m'"):
        MetricAggregator().record("m", value)


def test_unknown_reduction_is_refused_listing_the_valid_ones():
    """reduce='median' names the allowed set."""
    with pytest.raises(ValueError, match="median") as info:
        MetricAggregator().record("x", 1.0, "median")
    assert all(r in str(info.value) for r in REDUCTIONS)


def test_changing_a_metrics_reduction_within_a_step_is_an_error():
    """'loss' recorded as mean then sum in one step is refused; after a flush it may change."""
    agg = MetricAggregator()
    agg.record("loss", 1.0, "mean")
    with pytest.raises(ValueError, match="reduce='mean'.*reduce='sum'"):
        agg.record("loss", 1.0, "sum")
    agg.flush(0)
    agg.record("loss", 1.0, "sum")


def test_drain_and_extend_give_the_exact_mean_across_processes():
    """Raw records from two 'actors' merged in the controller: the mean of all values, not of means."""
    actor_a, actor_b, controller = MetricAggregator(), MetricAggregator(), MetricAggregator()
    actor_a.record("reward", 1.0)
    for _ in range(3):
        actor_b.record("reward", 0.0)
    controller.extend(actor_a.drain())
    controller.extend(actor_b.drain())
    assert len(actor_a) == 0 and len(actor_b) == 0
    assert controller.flush(0) == {"reward": 0.25}


def test_record_metric_goes_to_the_process_local_aggregator_until_drained():
    """record_metric then drain_local_metrics returns (name, value, reduce) tuples and empties it."""
    drain_local_metrics()  # start clean whatever ran before
    record_metric("latency_s", 0.5, "max")
    record_metric("latency_s", 0.25, "max")
    record_metric("reward", 1)
    records = drain_local_metrics()
    expected = [("latency_s", 0.5, "max"), ("latency_s", 0.25, "max"), ("reward", 1.0, "mean")]
    assert sorted(records) == sorted(expected)
    assert drain_local_metrics() == []
    agg = MetricAggregator()
    agg.extend(records)
    assert agg.flush(0) == {"latency_s": 0.5, "reward": 1.0}


def test_nan_values_are_kept_so_a_diverged_loss_is_visible():
    """NaN is a legitimate value to report (the JSONL sink writes it as null)."""
    agg = MetricAggregator()
    agg.record("loss", float("nan"))
    assert math.isnan(agg.flush(0)["loss"])
