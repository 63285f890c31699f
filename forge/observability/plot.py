"""Plot a run's metrics (reward, loss, ...) against step as a PNG, from its ``metrics.jsonl``."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

# The object-oriented Figure + Agg canvas, not pyplot: no global backend switch, no GUI, and
# safe to call from a worker process or a test.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from forge.observability.sinks import EVAL_STEP


def plot_run(
    metrics_jsonl_path: str | Path,
    out_png: str | Path,
    keys: Sequence[str] = ("reward_mean", "loss"),
    smoothing: float = 0.9,
    beside: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Write ``out_png`` with one subplot per key: the raw values faintly, an EMA line on top.

    ``smoothing`` is the exponential moving average weight (TensorBoard's slider; 0 = none).
    Rows without a key (or with ``null``) are skipped for that key; a key absent from every
    row gets an empty, labelled subplot so a typo shows up in the picture. ``beside`` draws
    other keys into a key's subplot as marked lines, e.g. ``{"reward_mean": ["eval/accuracy"]}``
    puts the held-out accuracy next to the training reward; an ``eval/*`` key is drawn at the
    step whose weights were evaluated (``eval/step``), not at the row that reported it.
    Returns the path.
    """
    path = Path(metrics_jsonl_path)
    if not keys:
        raise ValueError("keys must name at least one metric to plot")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    rows = _read_rows(path)
    if not rows:
        raise ValueError(f"{path} has no metric rows to plot")

    fig = Figure(figsize=(6.0, 2.6 * len(keys)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(keys), 1, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys):
        points = _points(rows, key)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        if not points:
            ax.text(0.5, 0.5, f"no data for {key!r}", ha="center", va="center", transform=ax.transAxes)
            continue
        steps, values = zip(*points)
        if key.startswith("eval/"):  # a few evaluations: each one a point, nothing to smooth
            ax.plot(steps, values, color="tab:orange", marker="o", markersize=3, linewidth=1.5, label=key)
        else:
            ax.plot(steps, values, color="tab:blue", alpha=0.3, linewidth=1, label="raw")
            ax.plot(steps, _ema(values, smoothing), color="tab:blue", linewidth=2, label="smoothed")
        for other, color in zip((beside or {}).get(key, ()), ("tab:orange", "tab:green", "tab:red")):
            marked = _points(rows, other)
            if marked:
                ax.plot(*zip(*marked), color=color, marker="o", markersize=3, linewidth=1.5, label=other)
        ax.legend(loc="best", fontsize="small")
    fig.tight_layout()

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _points(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of every row with a finite ``key``; ``eval/*`` keys at their ``eval/step``."""
    points = []
    for row in rows:
        value = row.get(key)
        if not (isinstance(value, (int, float)) and math.isfinite(value)):
            continue
        at = row.get(EVAL_STEP) if key.startswith("eval/") else None
        points.append((at if isinstance(at, (int, float)) else row["step"], value))
    return sorted(points)


def _read_rows(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError(f"{path}:{lineno}: expected an object with an integer 'step'")
            rows.append(row)
    return rows


def _ema(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average, like TensorBoard's smoothing (starts at values[0])."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg = weight * avg + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(avg / norm)
    return out
