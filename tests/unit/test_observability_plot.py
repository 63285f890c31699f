"""plot_run: a PNG of metrics against step, read from metrics.jsonl."""

import math

import pytest

from forge.observability import JsonlSink, plot_run
from forge.observability.plot import _ema

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, steps=50):
    sink = JsonlSink(tmp_path)
    for step in range(steps):
        metrics = {"reward_mean": 1 - math.exp(-step / 15), "loss": math.exp(-step / 20)}
        if step == 10:
            metrics["loss"] = float("nan")  # written as null, skipped in the plot
        sink.log(step, metrics)
    sink.close()
    return sink.path


def test_plot_run_writes_a_valid_png(tmp_path):
    """The file starts with the PNG signature and is more than a blank image."""
    out = plot_run(_run(tmp_path), tmp_path / "plots" / "run.png")
    data = out.read_bytes()
    assert out == tmp_path / "plots" / "run.png"
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000


def test_plot_run_handles_a_key_that_is_absent(tmp_path):
    """An unknown key gets an empty labelled subplot rather than an error."""
    out = plot_run(_run(tmp_path), tmp_path / "run.png", keys=("reward_mean", "not_logged"))
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_run_rejects_missing_or_empty_metrics(tmp_path):
    """No file, or a file with no rows, is an error naming the path."""
    with pytest.raises(FileNotFoundError, match="absent.jsonl"):
        plot_run(tmp_path / "absent.jsonl", tmp_path / "x.png")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no metric rows"):
        plot_run(empty, tmp_path / "x.png")


def test_plot_run_rejects_rows_without_a_step(tmp_path):
    """A line that is not {"step": int, ...} is reported with its line number."""
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"step": 0, "loss": 1}\n{"loss": 2}\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        plot_run(bad, tmp_path / "x.png")


def test_ema_starts_at_the_first_value_and_tracks_a_constant():
    """The debiased EMA of a constant is that constant from the first point."""
    assert _ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    smoothed = _ema([0.0, 1.0, 1.0, 1.0], 0.5)
    assert smoothed[0] == 0.0 and 0.0 < smoothed[1] < smoothed[2] < smoothed[3] < 1.0
