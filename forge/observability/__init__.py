"""Metrics from any actor, reduced per step, written to console/JSONL/TensorBoard, plotted at the end."""

from forge.observability.metrics import (
    REDUCTIONS,
    MetricAggregator,
    MetricRecord,
    drain_local_metrics,
    record_metric,
)
from forge.observability.plot import plot_run
from forge.observability.sinks import (
    ConsoleSink,
    JsonlSink,
    MetricSink,
    TensorBoardSink,
    make_sinks,
)

__all__ = [
    "REDUCTIONS",
    "ConsoleSink",
    "JsonlSink",
    "MetricAggregator",
    "MetricRecord",
    "MetricSink",
    "TensorBoardSink",
    "drain_local_metrics",
    "make_sinks",
    "plot_run",
    "record_metric",
]
