"""Where per-step metrics go: the console, a JSONL file, TensorBoard, Weights & Biases.

A sink is anything with ``log(step, metrics)`` and ``close()``. The JSONL file is the run's
record of truth (``plot_run`` reads it); the console line is for a human watching; TensorBoard
is optional and degrades to a no-op when the package is not installed; W&B runs offline unless
the user has configured it.

Evaluation figures (``eval/*``) arrive in the row of the step at which the evaluation finished,
with ``eval/step``: the step whose weights were evaluated (0: the initial model). TensorBoard and
W&B chart them against ``eval/step``, and so does ``plot_run``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

EVAL_STEP = "eval/step"
"""The step whose weights an evaluation's ``eval/*`` figures describe."""


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
    after every step, so a crashed run keeps every step it logged. A run resumed after step
    ``resume_after`` keeps the rows up to that step, drops the later ones (what the killed run
    logged after its last checkpoint, and a line cut short by the kill) and appends, so every
    step appears once. Non-finite values are written as ``null`` to keep the file strict JSON.
    """

    FILENAME = "metrics.jsonl"

    def __init__(self, output_dir: str | Path, resume_after: int | None = None) -> None:
        self.path = Path(output_dir) / self.FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_after is None:
            self._file: IO[str] | None = self.path.open("w", encoding="utf-8")
            return
        kept = [line for line in _read_lines(self.path) if _step_of(line) <= resume_after]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._file = self.path.open("a", encoding="utf-8")

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


def _read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def _step_of(line: str) -> float:
    """The ``step`` of one JSONL row; infinity for a line cut short or without a step."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, int) else math.inf


_tensorboard_warned = False


class TensorBoardSink:
    """Scalars to TensorBoard under ``<output_dir>/tensorboard``, if TensorBoard is installed.

    TensorBoard is optional: without it the sink logs one line saying so (once per process)
    and does nothing, so a config naming it never breaks a run. A run resumed after step
    ``resume_after`` purges the events logged past that step (TensorBoard's ``purge_step``).
    """

    def __init__(self, output_dir: str | Path, resume_after: int | None = None) -> None:
        global _tensorboard_warned
        self.log_dir = Path(output_dir) / "tensorboard"
        self._writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            if not _tensorboard_warned:
                logger.warning("TensorBoardSink disabled: %s (pip install tensorboard to enable it)", e)
                _tensorboard_warned = True
            return
        purge = None if resume_after is None else resume_after + 1
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is None:
            return
        eval_step = metrics.get(EVAL_STEP)
        for k, v in metrics.items():
            at = int(eval_step) if eval_step is not None and k.startswith("eval/") else step
            self._writer.add_scalar(k, v, global_step=at)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """Each step's metrics to a Weights & Biases run, with the run's resolved config.

    ``mode`` ``online``/``offline``/``disabled``; empty: ``$WANDB_MODE`` if set, else online when
    W&B is configured on this machine (``$WANDB_API_KEY``, or a ``wandb login`` entry in
    ``~/.netrc``), else offline: the run is written under ``<output_dir>/wandb`` and can be
    uploaded later with ``wandb sync``. A resumed run continues the same W&B run (its id is kept
    in ``<output_dir>/wandb_run_id``); W&B keeps the first value of a step logged twice.
    """

    RUN_ID_FILE = "wandb_run_id"

    def __init__(
        self,
        output_dir: str | Path,
        resume_after: int | None = None,
        *,
        project: str = "forge",
        name: str = "",
        mode: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        import wandb

        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        id_file = out / self.RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume_after is not None and id_file.is_file() else None
        self.mode = wandb_mode(mode)
        self.run = wandb.init(
            project=project or "forge",
            name=name or None,
            mode=self.mode,
            dir=str(out),
            config=config,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(console="off", silent=True),
        )
        id_file.write_text(self.run.id)
        self.run.define_metric(EVAL_STEP)
        self.run.define_metric("eval/*", step_metric=EVAL_STEP)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({k: float(v) for k, v in metrics.items()}, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            wandb.teardown()  # stops W&B's service process, which would outlive the run


def wandb_mode(mode: str = "") -> str:
    """The W&B mode a ``WandbSink`` runs in (see its docstring)."""
    if mode:
        if mode not in ("online", "offline", "disabled"):
            raise ValueError(f"wandb mode must be online, offline or disabled (or empty: automatic), got {mode!r}")
        return mode
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "online" if "api.wandb.ai" in netrc.read_text() else "offline"
    except OSError:
        return "offline"


_SINKS = {"console": ConsoleSink, "jsonl": JsonlSink, "tensorboard": TensorBoardSink, "wandb": WandbSink}


def make_sinks(
    names: list[str] | tuple[str, ...],
    output_dir: str | Path,
    resume_after: int | None = None,
    *,
    wandb: dict[str, Any] | None = None,
) -> list[MetricSink]:
    """Build the sinks named in ``names`` (``console``, ``jsonl``, ``tensorboard``, ``wandb``), in order.

    ``resume_after``: the step a resumed run continues after; the file sinks keep what was
    logged up to it and drop the rest. None starts afresh. ``wandb``: ``WandbSink``'s keyword
    arguments (``project``, ``name``, ``mode``, ``config``).
    """
    if isinstance(names, str):
        raise TypeError(f"names must be a list of sink names, got the string {names!r}")
    sinks: list[MetricSink] = []
    for name in names:
        if name not in _SINKS:
            raise ValueError(f"unknown metric sink {name!r}; expected one of {sorted(_SINKS)}")
        if name == "console":
            sinks.append(ConsoleSink())
        elif name == "wandb":
            sinks.append(WandbSink(output_dir, resume_after, **(wandb or {})))
        else:
            sinks.append(_SINKS[name](output_dir, resume_after))
    return sinks
