"""Collect metric values as they happen and reduce them once per training step.

Actors call ``record_metric(name, value, reduce)`` wherever a number is known (a reward, a
batch's latency, a loss). The values go to a process-local aggregator; the actor hands them
to the controller with ``drain_local_metrics()``, the controller feeds them into its own
``MetricAggregator`` with ``extend`` and calls ``flush(step)`` once a step. Raw values travel,
not per-process summaries, so a mean over several actors is the true mean of all values.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

MetricRecord = tuple[str, float, str]
"""``(name, value, reduce)``: one recorded value and how to combine it with others."""

REDUCTIONS: tuple[str, ...] = ("mean", "sum", "max", "min", "last")


def _to_float(name: str, value: Any) -> float:
    # Accepts Python numbers and one-element tensors/arrays (anything with .item()).
    if hasattr(value, "item"):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            raise ValueError(
                f"metric {name!r}: value must be a number or a one-element tensor, got shape "
                f"{tuple(getattr(value, 'shape', ()))}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {name!r}: value must be a number, got {type(value).__name__}")
    return float(value)


class MetricAggregator:
    """Values recorded during one step, reduced per metric name by ``flush(step)``.

    A name keeps one reduction for the whole step: recording ``loss`` as ``"mean"`` and then
    as ``"sum"`` is an error rather than a silently wrong number. Thread-safe, so an actor's
    background threads may record too.
    """

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = {}
        self._reduce: dict[str, str] = {}
        self._lock = threading.Lock()

    def record(self, name: str, value: Any, reduce: str = "mean") -> None:
        """Add one value of metric ``name``; ``reduce`` is one of ``REDUCTIONS``."""
        if reduce not in REDUCTIONS:
            raise ValueError(f"metric {name!r}: reduce must be one of {REDUCTIONS}, got {reduce!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"metric name must be a non-empty string, got {name!r}")
        x = _to_float(name, value)
        with self._lock:
            previous = self._reduce.setdefault(name, reduce)
            if previous != reduce:
                raise ValueError(
                    f"metric {name!r} was recorded with reduce={previous!r} this step and now with "
                    f"reduce={reduce!r}; use one reduction per name"
                )
            self._values.setdefault(name, []).append(x)

    def extend(self, records: Iterable[MetricRecord]) -> None:
        """Add records drained from another process (``drain_local_metrics``)."""
        for name, value, reduce in records:
            self.record(name, value, reduce)

    def flush(self, step: int) -> dict[str, float]:
        """The reduced value of every metric recorded since the last flush; then clear.

        ``step`` is not part of the result: it is the key under which sinks log the dict.
        It is accepted here so callers read as ``metrics = agg.flush(step)`` and so a future
        cross-process gather can tag its requests.
        """
        del step
        with self._lock:
            values, reduces = self._values, self._reduce
            self._values, self._reduce = {}, {}
        return {name: _reduce(reduces[name], xs) for name, xs in sorted(values.items())}

    def drain(self) -> list[MetricRecord]:
        """All raw records since the last flush/drain, in recording order per name; then clear."""
        with self._lock:
            values, reduces = self._values, self._reduce
            self._values, self._reduce = {}, {}
        return [(name, x, reduces[name]) for name, xs in values.items() for x in xs]

    def __len__(self) -> int:
        """Number of raw values held."""
        with self._lock:
            return sum(len(xs) for xs in self._values.values())


def _reduce(how: str, xs: list[float]) -> float:
    if how == "mean":
        return math.fsum(xs) / len(xs)
    if how == "sum":
        return math.fsum(xs)
    if how == "max":
        return max(xs)
    if how == "min":
        return min(xs)
    return xs[-1]  # "last"


_LOCAL = MetricAggregator()


def record_metric(name: str, value: Any, reduce: str = "mean") -> None:
    """Record into this process's default aggregator (callable from any actor or helper)."""
    _LOCAL.record(name, value, reduce)


def drain_local_metrics() -> list[MetricRecord]:
    """Take every record made in this process with ``record_metric`` since the last drain."""
    return _LOCAL.drain()
