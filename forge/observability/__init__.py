"""Metrics from any actor, reduced per step, written to console/JSONL/TensorBoard/W&B, plotted at the end."""

from forge.observability.metrics import (
    REDUCTIONS,
    MetricAggregator,
    MetricRecord,
    drain_local_metrics,
    record_metric,
)
from forge.observability.plot import plot_run
from forge.observability.sinks import (
    EVAL_STEP,
    ConsoleSink,
    JsonlSink,
    MetricSink,
    TensorBoardSink,
    WandbSink,
    make_sinks,
)

__all__ = [
    "EVAL_STEP",
    "REDUCTIONS",
    "ConsoleSink",
    "JsonlSink",
    "MetricAggregator",
    "MetricRecord",
    "MetricSink",
    "TensorBoardSink",
    "WandbSink",
    "drain_local_metrics",
    "make_sinks",
    "plot_run",
    "record_metric",
]
