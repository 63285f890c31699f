"""Where per-step metrics go: the console, a JSONL file, TensorBoard.

A sink is anything with ``log(step, metrics)`` and ``close()``. The JSONL file is the run's
record of truth (``plot_run`` reads it); the console line is for a human watching; TensorBoard
is optional and degrades to a no-op when the package is not installed.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@runtime_checkable
class MetricSink(Protocol):
    """Receives each step's reduced metrics."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One compact line per step through ``logging``: ``step 12 | loss 0.1234 | reward_mean 0.5``."""

    def __init__(self, log: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self._logger = log or logging.getLogger("forge.metrics")
        self._level = level

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step}"] + [f"{k} {v:.4g}" for k, v in sorted(metrics.items())]
        self._logger.log(self._level, " | ".join(parts))

    def close(self) -> None:
        pass


class JsonlSink:
    """``<output_dir>/metrics.jsonl``: one JSON object per step, ``{"step": n, ...metrics}``.

    The file is truncated when the sink opens (a run owns its output directory) and flushed
    after every step, so a crashed run keeps every step it logged. Non-finite values are
    written as ``null`` to keep the file strict JSON.
    """

    FILENAME = "metrics.jsonl"

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / self.FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("w", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._file is None:
            raise RuntimeError(f"JsonlSink for {self.path} is closed")
        row: dict[str, float | int | None] = {"step": int(step)}
        for k, v in metrics.items():
            v = float(v)
            row[k] = v if math.isfinite(v) else None
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_tensorboard_warned = False


class TensorBoardSink:
    """Scalars to TensorBoard under ``<output_dir>/tensorboard``, if TensorBoard is installed.

    TensorBoard is optional: without it the sink logs one line saying so (once per process)
    and does nothing, so a config naming it never breaks a run.
    """

    def __init__(self, output_dir: str | Path) -> None:
        global _tensorboard_warned
        self.log_dir = Path(output_dir) / "tensorboard"
        self._writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            if not _tensorboard_warned:
                logger.warning(
                    "TensorBoardSink disabled: %s (pip install tensorboard to enable it)", e
                )
                _tensorboard_warned = True
            return
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


_SINKS = {"console": ConsoleSink, "jsonl": JsonlSink, "tensorboard": TensorBoardSink}


def make_sinks(names: list[str] | tuple[str, ...], output_dir: str | Path) -> list[MetricSink]:
    """Build the sinks named in ``names`` (``console``, ``jsonl``, ``tensorboard``), in order."""
    if isinstance(names, str):
        raise TypeError(f"names must be a list of sink names, got the string {names!r}")
    sinks: list[MetricSink] = []
    for name in names:
        if name not in _SINKS:
            raise ValueError(f"unknown metric sink {name!r}; expected one of {sorted(_SINKS)}")
        sinks.append(ConsoleSink() if name == "console" else _SINKS[name](output_dir))
    return sinks
